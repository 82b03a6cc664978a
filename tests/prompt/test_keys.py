"""Prompt block keys: salt, LoRA, the n-1 rule, cache_salt validation, memoised chains."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeys.keys import block_keys, root_key
from prompt.errors import InvalidCacheSalt, InvalidPrompt, ModelNotServed
from prompt.keyer import KeyContext, Prompt, PromptKeyer, validate_cache_salt
from prompt.registry import ModelSpec, RendererRegistry


@pytest.fixture(scope="module")
def registry(tiny_dirs: dict[str, Path]) -> RendererRegistry:
    return RendererRegistry(
        [
            ModelSpec(name="base", block_size=8, tokenizer=tiny_dirs["llama3"], loras=("ad1",)),
            ModelSpec(name="other", block_size=16, tokenizer=tiny_dirs["chatml"]),
        ]
    )


def _body(model: str, **extra: object) -> dict[str, object]:
    content = "a fairly long user message that spans several blocks of tokens " * 3
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def test_prompt_keys_are_block_keys_of_the_ids(registry: RendererRegistry) -> None:
    p = registry.render_chat(_body("base"))
    assert p.block_size == 8 and p.model == "base" and p.lora_name is None
    assert len(p.block_keys) == p.num_tokens // 8 > 2
    assert p.block_keys == block_keys(p.token_ids, 8, model="base")


def test_salt_changes_block_zero_and_therefore_every_block(registry: RendererRegistry) -> None:
    plain = registry.render_chat(_body("base"))
    salted = registry.render_chat(_body("base", cache_salt="tenant-1"))
    assert salted.token_ids == plain.token_ids and salted.cache_salt == "tenant-1"
    assert all(a != b for a, b in zip(plain.block_keys, salted.block_keys, strict=True))
    assert salted.block_keys == block_keys(plain.token_ids, 8, model="base", cache_salt="tenant-1")
    # The salt enters block 0 only: block 1 chained from salted block 0 needs no salt.
    assert (
        salted.block_keys[1]
        == block_keys(
            plain.token_ids[8:16], 8, model="base", parent=salted.block_keys[0], first_block_index=1
        )[0]
    )


def test_lora_requests_key_on_the_base_model_with_the_adapter_name(
    registry: RendererRegistry,
) -> None:
    base = registry.render_chat(_body("base"))
    lora = registry.render_chat(_body("ad1"))
    assert lora.model == "base" and lora.lora_name == "ad1"
    assert lora.token_ids == base.token_ids
    assert lora.block_keys == block_keys(base.token_ids, 8, model="base", lora_name="ad1")
    # The adapter name is on every block: continuing a chain needs it too.
    assert (
        lora.block_keys[2]
        != block_keys(
            base.token_ids[16:24], 8, model="base", parent=lora.block_keys[1], first_block_index=2
        )[0]
    )


def test_models_do_not_share_keys(registry: RendererRegistry) -> None:
    assert root_key("base") != root_key("other")
    tokens = list(range(32))
    assert block_keys(tokens, 16, model="base") != block_keys(tokens, 16, model="other")


def test_event_token_ids_reproduce_prompt_keys(registry: RendererRegistry) -> None:
    """A BlockStored for blocks 1..2 with the prompt's ids continues the same chain."""
    p = registry.render_chat(_body("base", cache_salt="s"))
    stored = block_keys(
        p.token_ids[8:24],
        8,
        model="base",
        cache_salt="s",
        parent=p.block_keys[0],
        first_block_index=1,
    )
    assert stored == p.block_keys[1:3]


@pytest.mark.parametrize(
    ("tokens", "matched", "expected"),
    [(32, 2, 16), (33, 2, 32), (33, 5, 32), (16, 1, 0), (17, 1, 16), (1, 3, 0), (0, 1, 0)],
)
def test_expected_cached_tokens_recomputes_the_last_token(
    tokens: int, matched: int, expected: int
) -> None:
    p = Prompt(token_ids=list(range(tokens)), block_keys=[], block_size=16, model="m")
    assert p.expected_cached_tokens(matched) == expected


@pytest.mark.parametrize("salt", [None, "a", "x" * 128, "tenant:1 ünï"])
def test_valid_cache_salts(salt: str | None) -> None:
    assert validate_cache_salt(salt) == salt


@pytest.mark.parametrize("salt", ["", "x" * 129, "a@b", "a/b", "a\\b", "a\x00b", 5, ["x"]])
def test_invalid_cache_salts(salt: object) -> None:
    with pytest.raises(InvalidCacheSalt) as info:
        validate_cache_salt(salt)
    assert isinstance(info.value, InvalidPrompt) and info.value.param == "cache_salt"


def test_registry_validates_salt_before_rendering(registry: RendererRegistry) -> None:
    with pytest.raises(InvalidCacheSalt):
        registry.render_chat(_body("base", cache_salt="bad/salt"))
    with pytest.raises(InvalidCacheSalt):
        registry.render_completion({"model": "base", "prompt": "x", "cache_salt": ""})


def test_registry_resolution_errors(registry: RendererRegistry, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelNotServed):
        registry.render_chat(_body("nope"))
    with pytest.raises(InvalidPrompt):
        registry.render_chat({"messages": []})
    with pytest.raises(ValueError):
        registry.add_lora("x", base="nope")
    with pytest.raises(ValueError):
        registry.add_lora("y", base="ad1")
    with pytest.raises(ValueError):
        registry.add(ModelSpec(name="base", block_size=8, tokenizer=tiny_dirs["llama3"]))
    with pytest.raises(ValueError):
        RendererRegistry([ModelSpec(name="z", block_size=0)])
    assert "ad1" in registry and "nope" not in registry
    assert set(registry.models()) == {"base", "ad1", "other"}


def test_batched_completions_give_one_prompt_each(registry: RendererRegistry) -> None:
    prompts = registry.render_completion(
        {"model": "ad1", "prompt": ["first prompt text", "second"], "cache_salt": "s"}
    )
    assert len(prompts) == 2
    for p in prompts:
        assert p.lora_name == "ad1" and p.cache_salt == "s"
        assert p.block_keys == block_keys(
            p.token_ids, 8, model="base", cache_salt="s", lora_name="ad1"
        )


segment_lists = st.lists(
    st.tuples(st.integers(1, 12), st.lists(st.integers(0, 5000), max_size=40)), max_size=12
)


@settings(max_examples=150, deadline=None)
@given(
    runs=st.lists(segment_lists, min_size=1, max_size=4),
    bs=st.sampled_from([1, 3, 16]),
    salt=st.sampled_from([None, "s"]),
    lora=st.sampled_from([None, "ad"]),
)
def test_memoised_chain_equals_block_keys(
    runs: list[list[tuple[int, list[int]]]], bs: int, salt: str | None, lora: str | None
) -> None:
    keyer = PromptKeyer(max_nodes=7)
    ctx = KeyContext(model="m", block_size=bs, cache_salt=salt, lora_name=lora)
    content: dict[int, list[int]] = {}
    for run in runs:
        # A serial always names the same ids (as the segment cache guarantees).
        segments = [(serial, content.setdefault(serial, ids)) for serial, ids in run]
        flat = [t for _, ids in segments for t in ids]
        expected = block_keys(flat, bs, model="m", cache_salt=salt, lora_name=lora)
        assert keyer.keys(ctx, segments) == expected
        assert keyer.keys(ctx, segments) == expected


def test_keyer_reuses_the_shared_prefix() -> None:
    keyer = PromptKeyer()
    ctx = KeyContext(model="m", block_size=4)
    first = [(1, list(range(10))), (2, list(range(10, 20)))]
    keyer.keys(ctx, first)
    misses = keyer.misses
    keyer.keys(ctx, [*first, (3, [1, 2, 3, 4, 5])])
    assert keyer.misses == misses + 1


def test_a_trail_from_a_dropped_trie_is_not_grown_on() -> None:
    # A remembered prompt's trail holds chain states of the trie it was keyed in.  After
    # the trie is dropped (budget reset), the next turn must key from the new trie: growing
    # the old states would keep the dropped trie alive through the memo, without bound.
    keyer = PromptKeyer(max_nodes=10)
    ctx = KeyContext(model="m", block_size=4)
    first = [(1, list(range(10))), (2, list(range(10, 20)))]
    trail = keyer.trail(ctx, first)
    keyer.keys(ctx, [(serial, [serial] * 40) for serial in range(3, 9)])  # over the budget
    assert keyer.resets >= 1
    second = [*first, (9, [7] * 9)]
    flat = [t for _, ids in second for t in ids]
    resumed = keyer.trail(ctx, second, previous=trail, shared=2)
    assert resumed.keys == block_keys(flat, 4, model="m")
    assert not set(map(id, resumed.nodes)) & set(map(id, trail.nodes))
    assert not trail.nodes[-1].children  # the old state was not extended
    again = keyer.trail(ctx, [*second, (10, [1] * 4)], previous=resumed, shared=3)
    assert again.nodes[:3] == resumed.nodes  # same generation: resumed as before
