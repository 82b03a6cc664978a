"""Turn N+1 computed from turn N equals rendering and encoding the request whole.

Every request is a fresh copy of its body, as a new HTTP request is.  Over random
conversations sent turn after turn (growing, repeated, branched, edited, followed by a
reply rendered without a generation prompt, with generation prompt on and off, thinking
switched, salts and adapters varied) the text
equals transformers' ``apply_chat_template``, the ids equal ``tokenizers`` on the whole
text and the block keys equal ``block_keys`` over the ids.  The pieces underneath are
checked on their own: ``SegmentEncoder.split`` resuming any previous split equals a
fresh split, ``PromptKeyer.trail`` resuming any trail equals ``block_keys``, and
``plain_bytes`` tells apart what a template prints differently.  Negative cases: values
that are equal to Python but not to a template, non-plain messages, a resumed trail
under another key context, texts that share less than a whole added token.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeys.keys import block_keys
from prompt.conversation import CachedPrompt, ConversationMemo
from prompt.keyer import KeyContext, PromptKeyer
from prompt.plain_data import plain_bytes
from prompt.registry import ModelSpec, RendererRegistry
from prompt.render import Keying
from prompt.segments import SegmentEncoder
from prompt.template_env import detect_content_format
from prompt.tokenizer import load_tokenizer_files
from tests.prompt import tokenizer_text
from tests.prompt.tokenizer_text import VARIANTS

texts = tokenizer_text.texts(max_fragment=16, max_fragments=8)
arguments = st.one_of(
    st.just('{"x": 1}'),
    st.just('{"x": 1.0}'),
    st.just('{"x": true}'),
    st.just('{"y": 2, "x": 1}'),
    st.just('{"x": 1, "y": 2}'),
    st.just("not json"),
)


@st.composite
def a_message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant", "system", "user", "assistant"]))
    message: dict[str, Any] = {"role": role, "content": draw(texts)}
    if role == "assistant" and draw(st.booleans()):
        message["tool_calls"] = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": draw(arguments)},
            }
        ]
    return message


conversations = st.lists(a_message(), min_size=1, max_size=7)
requests = st.lists(
    st.tuples(
        st.integers(1, 7),  # how many messages
        st.sampled_from(["plain", "plain", "reply", "no_gen", "no_think", "edit", "salt"]),
    ),
    min_size=1,
    max_size=6,
)
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def registry(tiny_dirs: dict[str, Path]) -> RendererRegistry:
    return RendererRegistry(
        ModelSpec(name=v, block_size=bs, tokenizer=tiny_dirs[v], loras=(f"{v}-lora",))
        for v, bs in zip(VARIANTS, (4, 16, 7, 3), strict=True)
    )


def _reference_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands transformers for these messages (openai content format)."""
    out = []
    for m in copy.deepcopy(messages):
        msg: dict[str, Any] = {
            "role": m["role"],
            "content": [{"type": "text", "text": m["content"]}],
        }
        if "tool_calls" in m:
            for call in m["tool_calls"]:
                try:
                    args = json.loads(call["function"]["arguments"])
                except json.JSONDecodeError:
                    args = {}
                call["function"]["arguments"] = args if isinstance(args, dict) else {}
            msg["tool_calls"] = m["tool_calls"]
        out.append(msg)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@SETTINGS
@given(conversation=conversations, plan=requests)
def test_turns_equal_whole_rendering(
    variant: str,
    conversation: list[dict[str, Any]],
    plan: list[tuple[int, str]],
    registry: RendererRegistry,
    hf_tokenizer: Callable[[str], Any],
) -> None:
    target = registry.resolve(variant)
    assert target.renderer is not None
    hf = hf_tokenizer(variant)
    enc = target.renderer.encoder
    for n, kind in plan:
        messages = json.loads(json.dumps(conversation[:n]))  # a new request's objects
        body: dict[str, Any] = {"model": variant, "messages": messages}
        kwargs: dict[str, Any] = {"add_generation_prompt": True}
        if kind == "no_gen":
            body["add_generation_prompt"] = False
            kwargs["add_generation_prompt"] = False
        elif kind == "no_think":
            body["chat_template_kwargs"] = {"enable_thinking": False}
            kwargs["enable_thinking"] = False
        elif kind == "edit":
            messages[-1]["content"] += "!"
        elif kind == "salt":
            body["cache_salt"] = "s"
            body["model"] = f"{variant}-lora"
        prompt = registry.render_chat(body)
        text = hf.apply_chat_template(_reference_conversation(messages), tokenize=False, **kwargs)
        ids = enc.encode_uncached(text)
        assert target.renderer.chat_text(body).text == text
        assert prompt.token_ids == ids
        assert prompt.block_keys == block_keys(
            ids,
            target.spec.block_size,
            model=variant,
            cache_salt=body.get("cache_salt"),
            lora_name=f"{variant}-lora" if kind == "salt" else None,
        )
        if kind == "reply":  # the conversation and its reply, which the next turn extends
            reply = {"role": "assistant", "content": "a reply <|eot_id|> with <|im_end|> specials"}
            registry.render_chat(
                {**body, "messages": [*messages, reply], "add_generation_prompt": False}
            )


def test_next_turn_reuses_the_previous_one(registry: RendererRegistry) -> None:
    target = registry.resolve("llama3")
    assert target.renderer is not None
    renderer = target.renderer
    history = [
        {"role": "system", "content": "system prompt " * 40},
        {"role": "user", "content": "question " * 20},
    ]
    registry.render_chat({"model": "llama3", "messages": copy.deepcopy(history)})
    memo = renderer.conversations
    held = len(memo)
    hits, reused = memo.stats.hits, renderer.encoder.stats.reused
    keyer_misses = registry.keyer.misses
    grown = [*history, {"role": "assistant", "content": "answer " * 30}]
    grown.append({"role": "user", "content": "next"})
    fmt = detect_content_format(renderer.files.chat_template(None, has_tools=False))
    opened = memo.open(copy.deepcopy(grown), fmt)
    assert opened is not None and opened.previous is not None
    previous = opened.previous.messages.conversation
    assert opened.messages.conversation[:2] == previous
    assert opened.messages.conversation[0] is previous[0]  # built once, shared
    tok = renderer.render_chat(
        {"model": "llama3", "messages": copy.deepcopy(grown)},
        Keying(registry.keyer, target.key_context(None)),
    )
    assert memo.stats.hits == hits + 2
    assert renderer.encoder.stats.reused > reused
    assert tok.block_keys == block_keys(tok.token_ids, 4, model="llama3")
    assert 0 < registry.keyer.misses - keyer_misses < 20  # the new text only
    assert len(memo) == held  # the new prompt replaced the previous one


def test_a_replaced_last_message_reuses_the_history(registry: RendererRegistry) -> None:
    target = registry.resolve("llama3")
    assert target.renderer is not None
    renderer = target.renderer
    history = [
        {"role": "system", "content": "system prompt " * 40},
        {"role": "user", "content": "question " * 20},
        {"role": "assistant", "content": "answer " * 30},
    ]
    keying = Keying(registry.keyer, target.key_context(None))
    for tail in ("first question", "the question edited", "a third one"):
        messages = [*copy.deepcopy(history), {"role": "user", "content": tail}]
        hits, reused = renderer.conversations.stats.hits, renderer.encoder.stats.reused
        tok = renderer.render_chat({"model": "llama3", "messages": messages}, keying)
        if tail != "first question":  # found the previous request, without its question
            assert renderer.conversations.stats.hits == hits + 1
            assert renderer.encoder.stats.reused > reused
        memo = renderer.conversations
        renderer.conversations = ConversationMemo()
        try:
            fresh = renderer.render_chat({"model": "llama3", "messages": messages}, keying)
        finally:
            renderer.conversations = memo
        assert tok.token_ids == fresh.token_ids and tok.block_keys == fresh.block_keys
    # The memo holds one prompt for the conversation (each replaced the one it reused).
    kept = [p for p, _ in renderer.conversations._prompts.values()
            if p.messages.snapshot is not None and p.messages.snapshot[:3] == history]
    assert len(kept) == 1


def test_values_equal_to_python_but_not_to_a_template_are_not_reused(
    registry: RendererRegistry, hf_tokenizer: Callable[[str], Any]
) -> None:
    """``1``, ``1.0`` and ``true`` are equal in Python; the template prints each."""
    hf = hf_tokenizer("chatml")

    def conversation(value: object) -> list[dict[str, Any]]:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": value}}}
        return [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]

    registry.render_chat({"model": "chatml", "messages": conversation(1)})
    seen = set()
    for value in (1.0, True, 1):
        later = [*conversation(value), {"role": "user", "content": "again"}]
        prompt = registry.render_chat({"model": "chatml", "messages": later})
        reference = _reference_conversation([{**m, "tool_calls": []} for m in later])
        reference[1]["tool_calls"] = later[1]["tool_calls"]
        ref = hf.apply_chat_template(
            reference, tokenize=True, return_dict=False, add_generation_prompt=True
        )
        assert prompt.token_ids == ref
        seen.add(tuple(ref))
    assert len(seen) == 3


def test_text_only_messages_compare_by_mapping_and_others_by_bytes(
    registry: RendererRegistry, hf_tokenizer: Callable[[str], Any]
) -> None:
    """A text-only message is the same message whatever its key order or unknown keys
    (the conversation built from it is); a ``None`` content makes it another one."""
    hf = hf_tokenizer("llama3")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    registry.render_chat({"model": "llama3", "messages": copy.deepcopy(history)})
    variants: list[list[dict[str, Any]]] = [
        [{"content": "hi", "role": "user"}, {"role": "assistant", "content": "yo", "x": "y"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo "}],
    ]
    for messages in variants:
        sent = [*messages, {"role": "user", "content": "more"}]
        prompt = registry.render_chat({"model": "llama3", "messages": sent})
        reference = [
            {
                "role": m["role"],
                "content": [] if m["content"] is None else [{"type": "text", "text": m["content"]}],
            }
            for m in sent
        ]
        ref = hf.apply_chat_template(
            reference, tokenize=True, return_dict=False, add_generation_prompt=True
        )
        assert prompt.token_ids == ref


def test_messages_that_are_not_plain_data_are_rendered_without_a_turn(
    registry: RendererRegistry,
) -> None:
    renderer = registry.resolve("llama3").renderer
    assert renderer is not None
    body = {"model": "llama3", "messages": [OrderedDict(role="user", content="hi")]}
    remembered = len(renderer.conversations)
    renderer.tokenize_chat(body)
    assert len(renderer.conversations) == remembered
    plain = {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}
    assert renderer.tokenize_chat(body).token_ids == renderer.tokenize_chat(plain).token_ids


def test_continuing_a_reused_final_message_leaves_the_turn_intact(
    registry: RendererRegistry, hf_tokenizer: Callable[[str], Any]
) -> None:
    hf = hf_tokenizer("chatml")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    body = {"model": "chatml", "messages": messages, "add_generation_prompt": False}
    registry.render_chat(copy.deepcopy(body))
    cont = {**copy.deepcopy(body), "continue_final_message": True}
    for _ in range(2):
        prompt = registry.render_chat(cont)
        ref = hf.apply_chat_template(
            _reference_conversation(messages),
            tokenize=True,
            return_dict=False,
            continue_final_message=True,
        )
        assert prompt.token_ids == ref
    again = registry.render_chat(copy.deepcopy(body))
    assert again.token_ids == hf.apply_chat_template(
        _reference_conversation(messages), tokenize=True, return_dict=False
    )


def _remember(memo: ConversationMemo, messages: object, fmt: Any = "string") -> Any:
    opened = memo.open(messages, fmt)
    assert opened is not None
    memo.remember(CachedPrompt(opened.messages), replacing=opened.previous)
    return opened


def test_the_memo_is_bounded() -> None:
    memo = ConversationMemo(max_bytes=2_000)
    for i in range(50):
        _remember(memo, [{"role": "user", "content": f"conversation {i} " * 5}])
        assert memo.held_bytes <= 2_000
    assert memo.stats.evictions > 0
    assert 0 < len(memo) < 50
    assert memo.open("not a list", "string") is None
    assert memo.open([], "string") is None


def test_a_turn_replaces_its_base() -> None:
    memo = ConversationMemo()
    _remember(memo, [{"role": "user", "content": "a"}])
    opened = _remember(
        memo, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert opened.previous is not None
    assert len(memo) == 1
    assert memo.open([{"role": "user", "content": "a"}], "openai") is not None
    assert memo.stats.hits == 1


# -- the pieces ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoders(tiny_dirs: dict[str, Path]) -> dict[str, SegmentEncoder]:
    return {v: SegmentEncoder(load_tokenizer_files(tiny_dirs[v]).tokenizer) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shared=texts, first=texts, second=texts)
def test_resumed_split_equals_fresh_split(
    variant: str, shared: str, first: str, second: str, encoders: dict[str, SegmentEncoder]
) -> None:
    enc = encoders[variant]
    previous = enc.split(shared + first)
    resumed = enc.split(shared + second, previous)
    fresh = enc.split(shared + second)
    ids = [i for _, piece in resumed.segments for i in piece]
    assert ids == enc.encode_uncached(shared + second)
    assert [list(p) for _, p in resumed.segments] == [list(p) for _, p in fresh.segments]
    assert resumed.offsets == fresh.offsets and resumed.counts == fresh.counts
    assert resumed.ids == ids == fresh.ids and resumed.tokens == fresh.tokens
    assert all(
        sum(len(p) for _, p in fresh.segments[:count]) == tokens
        for count, tokens in zip(fresh.counts, fresh.tokens, strict=True)
    )
    assert resumed.segments[: resumed.shared] == previous.segments[: resumed.shared]


def test_a_cut_near_the_end_of_the_shared_text_is_not_kept(
    encoders: dict[str, SegmentEncoder],
) -> None:
    """``<|start_header_id|>`` ends the shared text, but ``<|start_header_id|>sys`` is a
    longer added token: the old cut must not be kept."""
    enc = encoders["llama3_extra"]
    previous = enc.split("hello <|start_header_id|>")
    resumed = enc.split("hello <|start_header_id|>system", previous)
    assert resumed.shared == 0
    assert [i for _, p in resumed.segments for i in p] == enc.encode_uncached(
        "hello <|start_header_id|>system"
    )


segment_lists = st.lists(
    st.lists(st.integers(0, 50), max_size=9).map(tuple), min_size=1, max_size=12
).map(lambda pieces: [(i + 1, list(p)) for i, p in enumerate(pieces)])


@settings(max_examples=200, deadline=None)
@given(
    first=segment_lists,
    tail=segment_lists,
    shared=st.integers(0, 14),
    block_size=st.integers(1, 6),
    salt=st.sampled_from([None, "s"]),
    other_ctx=st.booleans(),
)
def test_resumed_keys_equal_block_keys(
    first: list[tuple[int, list[int]]],
    tail: list[tuple[int, list[int]]],
    shared: int,
    block_size: int,
    salt: str | None,
    other_ctx: bool,
) -> None:
    keyer = PromptKeyer(max_nodes=7)  # small: generational resets happen mid-prompt
    ctx = KeyContext(model="m", block_size=block_size, cache_salt=salt)
    trail = keyer.trail(ctx, first)
    kept = list(trail.keys)
    shared = min(shared, len(first))
    second = [*first[:shared], *((s + 100, p) for s, p in tail)]
    ctx2 = KeyContext(model="m2", block_size=block_size) if other_ctx else ctx
    trail2 = keyer.trail(ctx2, second, previous=trail, shared=shared)
    ids = [i for _, p in second for i in p]
    expected = block_keys(ids, block_size, model=ctx2.model, cache_salt=ctx2.cache_salt)
    assert trail2.keys == expected == keyer.keys(ctx2, second)
    assert len(trail2.nodes) == len(second)
    assert trail.keys == kept  # the previous trail is a value: unchanged


def test_plain_bytes_tells_apart_what_templates_print_differently() -> None:
    distinct = [1, 1.0, True, -0.0, 0.0, "1", [1], (1,), {"a": 1, "b": 2}, {"b": 2, "a": 1}]
    encoded = [plain_bytes(v) for v in distinct]
    assert None not in encoded
    assert len(set(encoded)) == len(distinct)
    assert plain_bytes({"a": [1, "x"]}) == plain_bytes({"a": [1, "x"]})

    class Text(str):
        pass

    for odd in (OrderedDict(a=1), Text("x"), [object()], {"k": Text("v")}):
        assert plain_bytes(odd) is None


def test_a_developer_message_in_a_later_turn_is_converted_as_from_scratch(
    registry: RendererRegistry,
) -> None:
    """The cached prompt remembers whether its conversation holds a developer message; a
    later turn that adds one (or keeps one from its base) renders as the request alone
    does."""
    target = registry.resolve("llama3")  # its template refuses an unconverted developer
    assert target.renderer is not None
    renderer = target.renderer
    memo = renderer.conversations
    history: list[dict[str, Any]] = [{"role": "user", "content": "q1"}]
    turns = [
        [{"role": "assistant", "content": "a1"}, {"role": "developer", "content": "be brief"}],
        [{"role": "user", "content": "q2"}],
        [{"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}],
    ]
    fmt = detect_content_format(renderer.files.chat_template(None, has_tools=False))
    for added in [[], *turns]:
        history = [*history, *added]
        body = {"model": "llama3", "messages": copy.deepcopy(history)}
        hits = memo.stats.hits
        incremental = renderer.tokenize_chat(copy.deepcopy(body))
        assert memo.stats.hits == hits + 1 or not added
        renderer.conversations = ConversationMemo()
        try:
            fresh = renderer.tokenize_chat(copy.deepcopy(body))
        finally:
            renderer.conversations = memo
        assert incremental.token_ids == fresh.token_ids
        opened = memo.open(copy.deepcopy(history), fmt)
        assert opened is not None
        assert opened.messages.has_developer == any(m["role"] == "developer" for m in history)


@pytest.mark.parametrize("variant", ["llama3", "chatml"])
@SETTINGS
@given(
    conversation=conversations,
    steps=st.lists(st.tuples(st.sampled_from([1, 1, 1, 0, -1]), st.booleans()), max_size=10),
    edits=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_lists_of_released_prompts_are_reused_and_held_ones_never_change(
    variant: str,
    conversation: list[dict[str, Any]],
    steps: list[tuple[int, bool]],
    edits: list[bool],
    registry: RendererRegistry,
    hf_tokenizer: Callable[[str], Any],
) -> None:
    """A prompt still held keeps its ids and keys whatever later turns do, and every
    prompt equals the request rendered and keyed whole.  Requests mostly grow the
    conversation (the next turn), sometimes repeat it (a retry) or step back (a branch),
    prompts are held or dropped at random."""
    target = registry.resolve(variant)
    assert target.renderer is not None
    enc = target.renderer.encoder
    kept: list[tuple[Any, list[int], list[int]]] = []
    n = 1
    for (step, hold), edit in zip(steps, edits, strict=False):
        n = min(max(n + step, 1), len(conversation))
        messages = json.loads(json.dumps(conversation[:n]))
        if edit and step < 0:
            messages[-1]["content"] += "!"
        prompt = registry.render_chat({"model": variant, "messages": messages})
        text = hf_tokenizer(variant).apply_chat_template(
            _reference_conversation(messages), tokenize=False, add_generation_prompt=True
        )  # not through the renderer: its conversation memo is what is under test
        assert prompt.token_ids == enc.encode_uncached(text)
        assert prompt.block_keys == block_keys(
            prompt.token_ids, target.spec.block_size, model=variant
        )
        if hold:
            kept.append((prompt, list(prompt.token_ids), list(prompt.block_keys)))
        del prompt
        for old, ids, keys in kept:
            assert old.token_ids == ids and old.block_keys == keys


def test_a_registered_model_compiles_its_templates_before_the_first_request(
    tiny_dirs: dict[str, Path],
) -> None:
    """The first chat of a router process finds its templates compiled: compiling them
    on first use cost ~50 ms on the event loop (the first request's stall)."""
    from prompt.message_loop import message_loops
    from prompt.template_env import compile_template, template_variables

    caches = (compile_template, template_variables, detect_content_format, message_loops)
    for cache in caches:
        cache.cache_clear()
    registry = RendererRegistry([ModelSpec(name="m", block_size=16, tokenizer=tiny_dirs["llama3"])])
    misses = [cache.cache_info().misses for cache in caches]
    assert all(misses), misses
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    assert registry.render_chat(body).token_ids
    assert [cache.cache_info().misses for cache in caches] == misses
