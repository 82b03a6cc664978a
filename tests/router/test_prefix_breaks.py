"""Prefix-break detection: where and why a session's prompt stopped being append-only."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.prefix_breaks import detect_break, divergence, pack_tokens, prompt_shape


@given(st.lists(st.integers(0, 2**32 - 1), max_size=60),
       st.lists(st.integers(0, 2**32 - 1), max_size=60))
def test_divergence_matches_a_naive_scan(a: list[int], b: list[int]) -> None:
    _check_divergence(a, b)


def _check_divergence(a: list[int], b: list[int]) -> None:
    expected = None
    if b[: len(a)] != a:
        expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                        min(len(a), len(b)))
    assert divergence(pack_tokens(a), pack_tokens(b)) == expected


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300),
       st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=8))
def test_divergence_of_prompts_sharing_a_prefix(
    shared: list[int], a: list[int], b: list[int]
) -> None:
    """The bisection (in place, over views) finds where two long prompts part, as a scan
    does; ids that differ in one byte only included."""
    _check_divergence(shared + a, shared + b)
    near = [*shared, 1 << 24] if shared else [1 << 24]
    _check_divergence(near + a, [*near[:-1], 1] + b)


def body(*contents: str, system: str = "sys", **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
             for i, c in enumerate(contents)]
    return {"messages": msgs, **extra}


P1 = pack_tokens(range(100))


def test_append_only_is_not_a_break() -> None:
    assert detect_break(P1, prompt_shape(body("q")), pack_tokens(range(150)),
                        prompt_shape(body("q", "a", "q2"))) is None


@pytest.mark.parametrize(
    ("old", "new", "cause", "index", "role"),
    [
        (body("q", system="time 10:00"), body("q", "a", "q2", system="time 10:01"),
         "message_edited", 0, "system"),
        (body("q", "a", "q2"), body("q", "EDITED", "q2", "a2", "q3"), "message_edited", 2,
         "assistant"),
        (body("q", "a", "q2"), body("q2"), "message_edited", 1, "user"),
        (body("q", "a", "q2"), body("q"), "messages_dropped", 2, "assistant"),
        (body("q", tools=[{"a": 1}, {"b": 2}]), body("q", "a", "q2", tools=[{"b": 2}, {"a": 1}]),
         "tools_changed", None, None),
        (body("q"), body("q", "a", "q2", chat_template_kwargs={"enable_thinking": False}),
         "options_changed", None, None),
        (body("q"), body("q", "a", "q2"), "template", None, None),
    ],
)
def test_causes(old: dict[str, Any], new: dict[str, Any], cause: str, index: int | None,
                role: str | None) -> None:
    new_tokens = pack_tokens([*range(40), 9999, *range(41, 130)])
    br = detect_break(P1, prompt_shape(old), new_tokens, prompt_shape(new))
    assert br is not None
    assert (br.position, br.cause, br.message_index, br.message_role) == (40, cause, index, role)
    assert br.previous_tokens == 100 and br.new_tokens == 130 and br.lost_tokens == 60


def test_message_offsets_locate_the_break_exactly() -> None:
    new_tokens = pack_tokens([*range(40), 9999, *range(41, 130)])
    br = detect_break(P1, prompt_shape(body("q")), new_tokens,
                      prompt_shape(body("q", "a", "q2")), message_offsets=[0, 30, 60, 90])
    assert br is not None and br.message_index == 1 and br.message_role == "user"


def test_completions_and_missing_bodies() -> None:
    br = detect_break(P1, prompt_shape({"prompt": "x"}), pack_tokens([5]),
                      prompt_shape({"prompt": "y"}))
    assert br is not None and br.cause == "prompt_changed" and br.position == 0
    assert prompt_shape(None).is_chat is False
    odd = prompt_shape({"messages": ["not a dict"], "tools": {1, 2}})
    assert odd.roles == ("",)
