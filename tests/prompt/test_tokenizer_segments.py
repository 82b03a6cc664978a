"""Incremental tokenisation is identical to whole-text tokenisation.

Properties over random texts and random multi-turn conversations, for tokenizers with
different special tokens, normalisers and prefix-space behaviour: the cached,
special-token-split encoding equals ``tokenizers``' encoding of the whole text, turn
after turn, and the incremental block keys equal ``block_keys`` over the whole ids.
Tokenizers whose pre-tokenizer treats the start of the input specially must be
detected and still encoded exactly (whole-text fallback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from kvkeys.keys import block_keys
from prompt.registry import ModelSpec, RendererRegistry
from prompt.segments import SegmentEncoder
from prompt.tokenizer import load_tokenizer_files
from tests.prompt import tokenizer_text
from tests.prompt.tokenizer_text import VARIANTS

texts = tokenizer_text.texts(max_fragment=24, max_fragments=12)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def encoders(tiny_dirs: dict[str, Path]) -> dict[str, SegmentEncoder]:
    return {v: SegmentEncoder(load_tokenizer_files(tiny_dirs[v]).tokenizer) for v in VARIANTS}


@pytest.fixture(scope="module")
def registry(tiny_dirs: dict[str, Path]) -> RendererRegistry:
    return RendererRegistry(
        ModelSpec(name=v, block_size=bs, tokenizer=tiny_dirs[v], loras=(f"{v}-lora",))
        for v, bs in zip(VARIANTS, (4, 16, 7, 32), strict=True)
    )


def test_tiny_tokenizers_are_splittable(encoders: dict[str, SegmentEncoder]) -> None:
    for variant, enc in encoders.items():
        assert enc.splittable, (variant, enc.unsplittable_reason)


@pytest.mark.parametrize("variant", VARIANTS)
@SETTINGS
@given(text=texts, add_special_tokens=st.booleans())
def test_segment_encoding_equals_whole_encoding(
    variant: str, text: str, add_special_tokens: bool, encoders: dict[str, SegmentEncoder]
) -> None:
    enc = encoders[variant]
    expected = enc.encode_uncached(text, add_special_tokens=add_special_tokens)
    assert enc.encode(text, add_special_tokens=add_special_tokens) == expected
    assert enc.encode(text, add_special_tokens=add_special_tokens) == expected  # warm


roles = st.sampled_from(["user", "assistant", "system", "tool"])
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": texts}), min_size=1, max_size=10
)


@pytest.mark.parametrize("variant", VARIANTS)
@SETTINGS
@given(
    conversation=messages,
    salt=st.one_of(st.none(), st.sampled_from(["tenant-a", "b"])),
    lora=st.booleans(),
)
def test_incremental_turns_equal_whole_prompt(
    variant: str,
    conversation: list[dict[str, Any]],
    salt: str | None,
    lora: bool,
    registry: RendererRegistry,
) -> None:
    target = registry.resolve(variant)
    assert target.renderer is not None
    enc = target.renderer.encoder
    model = f"{variant}-lora" if lora else variant
    for turn in range(1, len(conversation) + 1):
        body: dict[str, Any] = {"model": model, "messages": conversation[:turn]}
        if salt is not None:
            body["cache_salt"] = salt
        prompt = registry.render_chat(body)
        text = target.renderer.chat_text(body).text
        whole = enc.encode_uncached(text)
        assert prompt.token_ids == whole
        assert prompt.block_keys == block_keys(
            whole,
            target.spec.block_size,
            model=variant,
            cache_salt=salt,
            lora_name=model if lora else None,
        )


def _metaspace_tokenizer(tmp: Path, scheme: str, lstrip: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    corpus = ["hello world this is a test", "the quick brown fox", "sys user assistant"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(
        [
            AddedToken("<s>", special=True, normalized=False, lstrip=lstrip),
            AddedToken("</s>", special=True, normalized=False),
        ]
    )
    return tok


@pytest.mark.parametrize(
    ("scheme", "lstrip", "splittable"),
    [("first", False, False), ("always", False, True), ("always", True, False)],
)
def test_start_sensitive_tokenizers_fall_back_exactly(
    tmp_path: Path, scheme: str, lstrip: bool, splittable: bool
) -> None:
    tok = _metaspace_tokenizer(tmp_path, scheme, lstrip)
    enc = SegmentEncoder(tok)
    assert enc.splittable is splittable
    if not splittable:
        assert enc.unsplittable_reason
    for text in ["<s>hello world</s> the fox", "a <s> b</s>c", "</s></s> quick", ""]:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids


def test_first_scheme_really_differs_when_split(tmp_path: Path) -> None:
    """The fallback is needed: splitting a Metaspace(first) text changes the ids."""
    tok = _metaspace_tokenizer(tmp_path, "first")
    text = "<s>hello world"
    split = (
        tok.encode("<s>", add_special_tokens=False).ids
        + tok.encode("hello world", add_special_tokens=False).ids
    )
    assert split != tok.encode(text, add_special_tokens=False).ids


def test_cache_is_bounded_and_evicts_oldest(encoders: dict[str, SegmentEncoder]) -> None:
    tok = encoders["chatml"]._tok
    enc = SegmentEncoder(tok, max_cached_tokens=50)
    pieces = [f"piece number {i} with several words" for i in range(20)]
    for p in pieces:
        enc.encode(f"<|im_start|>{p}<|im_end|>")
    assert enc.cached_tokens <= 50
    assert enc.stats.evictions > 0
    misses = enc.stats.misses
    enc.encode(f"<|im_start|>{pieces[-1]}<|im_end|>")
    assert enc.stats.misses == misses  # the newest piece is still cached
    enc.encode(f"<|im_start|>{pieces[0]}<|im_end|>")
    assert enc.stats.misses == misses + 1  # the oldest was evicted
    assert enc.encode("<|im_start|>x") == enc.encode_uncached("<|im_start|>x")


def test_warm_turn_encodes_only_new_pieces(registry: RendererRegistry) -> None:
    target = registry.resolve("chatml")
    assert target.renderer is not None
    enc = target.renderer.encoder
    history = [
        {"role": "system", "content": "system prompt " * 50},
        {"role": "user", "content": "question one " * 20},
        {"role": "assistant", "content": "answer one " * 30},
    ]
    registry.render_chat({"model": "chatml", "messages": history})
    before = enc.stats.tokens_encoded
    new_turn = {"role": "user", "content": "a brand new question"}
    prompt = registry.render_chat({"model": "chatml", "messages": [*history, new_turn]})
    encoded = enc.stats.tokens_encoded - before
    assert 0 < encoded < 20 < prompt.num_tokens


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.text(alphabet="<|>ab x", min_size=1, max_size=4), min_size=1, max_size=6),
    text=st.text(alphabet="<|>ab xy", max_size=40),
)
def test_splitter_is_leftmost_longest_like_the_regex(tokens: list[str], text: str) -> None:
    import re

    from prompt.segments import _Splitter

    ordered = sorted(set(tokens), key=lambda t: (-len(t), t))
    regex = re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")")
    assert _Splitter(tokens).split(text) == regex.split(text)


@pytest.mark.parametrize("variant", ["llama3", "chatml"])
def test_prewarmed_reply_leaves_only_the_user_message(
    variant: str, registry: RendererRegistry
) -> None:
    target = registry.resolve(variant)
    assert target.renderer is not None
    enc = target.renderer.encoder
    first = {
        "model": variant,
        "messages": [{"role": "user", "content": "first question about caches"}],
        "cache_salt": "t",
    }
    reply = "a long assistant reply about prefix caching " * 5
    registry.render_chat(first)
    registry.prewarm_reply(first, reply)
    nxt = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "and a follow-up"},
        ],
    }
    before = enc.stats.tokens_encoded
    prompt = registry.render_chat(nxt)
    encoded = enc.stats.tokens_encoded - before
    assert encoded <= 12 < len(enc.encode_uncached(reply))  # the follow-up, not the reply
    whole = enc.encode_uncached(target.renderer.chat_text(nxt).text)
    assert prompt.token_ids == whole
    assert prompt.block_keys == block_keys(
        whole, target.spec.block_size, model=variant, cache_salt="t"
    )
    registry.prewarm_reply({"model": "unknown", "messages": []}, "x")  # never raises
    registry.prewarm_reply({**first, "cache_salt": "bad/salt"}, "x")
    registry.prewarm_reply({"model": variant, "messages": "not a list"}, "x")
