"""The memoised message loop renders exactly what the template renders.

For templates whose loop qualifies (message-local bodies, position-dependent ones,
free variables set before the loop, ``continue``, ``{% generation %}``) and templates
that must be refused (``loop.last``, neighbours through ``messages``, namespaces,
``break``, macros, time), over random conversations rendered turn after turn: the
output always equals the plain Jinja rendering, reuse happens only where it is sound,
and a refused template is never transformed.
"""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prompt.message_loop import LoopFallback, LoopRecord, MessageLoops, message_loops
from prompt.template_env import compile_template, render_template
from replica.vllm.tiny_tokenizer import CHATML_TEMPLATE, LLAMA3_TEMPLATE

ACCEPTED = {
    "llama3": LLAMA3_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
    "position": (
        "{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "[{{ loop.index }}{{ '*' if loop.first else '' }}:{{ m['role'] }}={{ m['content'] }}]"
        "{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}"
    ),
    "prefix_variable": (
        "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] %}"
        "{% set rest = messages[1:] %}{% else %}{% set prefix = '' %}"
        "{% set rest = messages %}{% endif %}"
        "{% for m in rest %}<{{ m['role'] }}>{{ (prefix ~ '|') if loop.first else '' }}"
        "{{ m['content'] | trim }}{% set x = 1 %}</{{ m['role'] }}>{% endfor %}"
    ),
    "continue_and_generation": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}"
        "{% endif %}{% generation %}({{ message['content'] }}){% endgeneration %}"
        "{% for c in message.get('tool_calls', []) %}{{ c | tojson }}"
        "{% if not loop.last %},{% endif %}{% endfor %}{% endfor %}"
    ),
    "kwarg_in_body": (
        "{% for m in messages %}{{ m['content'] }}{% if sep is defined %}{{ sep }}{% endif %}"
        "{% endfor %}"
    ),
}
REFUSED = {
    "last": "{% for m in messages %}{{ m['content'] }}{% if not loop.last %},{% endif %}"
    "{% endfor %}",
    "length": "{% for m in messages %}{{ loop.length }}{{ m['content'] }}{% endfor %}",
    "neighbour": "{% for m in messages %}{% if loop.index0 > 0 %}"
    "{{ messages[loop.index0 - 1]['role'] }}{% endif %}{{ m['content'] }}{% endfor %}",
    "alias_in_body": "{% set ms = messages %}{% for m in ms %}{{ ms | length }}{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ ns.n }}{% endfor %}",
    "namespace_read": "{% set ns = namespace(n=0) %}{% for m in messages %}{{ ns.n }}{% endfor %}",
    "break": "{% for m in messages %}{% if m['role'] == 'tool' %}{% break %}{% endif %}"
    "{{ m['content'] }}{% endfor %}",
    "macro": "{% macro show(m) %}{{ m['content'] }}{% endmacro %}"
    "{% for m in messages %}{{ show(m) }}{% endfor %}",
    "time": "{% for m in messages %}{{ strftime_now('%Y') }}{{ m['content'] }}{% endfor %}",
    "random": "{% for m in messages %}{{ [1, 2] | random }}{% endfor %}",
    "previtem": "{% for m in messages %}{{ loop.previtem }}{% endfor %}",
    "bare_loop": "{% for m in messages %}{% set l = loop %}{{ l.index }}{% endfor %}",
    "else": "{% for m in messages %}{{ m['content'] }}{% else %}none{% endfor %}",
    "filtered": "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}",
}

roles = st.sampled_from(["user", "assistant", "system", "tool"])
contents = st.one_of(
    st.text(alphabet="ab <|>\n\x00{}'\"é", max_size=12),
    st.just("\x00kvroute-message-loop\x01"),  # the separator itself
)
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=8)


def _context(conversation: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "bos_token": "<s>",
        "messages": conversation,
        "tools": None,
        "documents": None,
        "add_generation_prompt": True,
        **extra,
    }


def _render_both(source: str, context: dict[str, Any], base: list[LoopRecord]) -> tuple[str, Any]:
    """(plain Jinja's output or its error type, (memoised output, records) or error type)."""
    try:
        reference: Any = compile_template(source).render(**context)
    except Exception as exc:  # noqa: BLE001 - the same error is expected from both
        reference = type(exc)
    try:
        memo: Any = message_loops(source).render(context, base)
    except LoopFallback:
        memo = (reference, [])
    except Exception as exc:  # noqa: BLE001
        memo = (type(exc), [])
    return reference, memo


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_qualifying_templates_are_transformed(name: str) -> None:
    loops = MessageLoops(ACCEPTED[name])
    assert loops.template is not None, loops.reason
    assert loops.loop_count == 1


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsound_loops_are_refused(name: str) -> None:
    loops = MessageLoops(REFUSED[name])
    assert loops.template is None
    assert loops.reason
    with pytest.raises(LoopFallback):
        loops.render(_context([{"role": "user", "content": "x"}]))


@pytest.mark.parametrize("name", sorted(ACCEPTED))
@settings(max_examples=80, deadline=None)
@given(
    conversation=messages,
    cuts=st.lists(st.integers(0, 8), min_size=1, max_size=4),
    sep=st.one_of(st.none(), st.sampled_from(["|", "||"])),
)
def test_turn_after_turn_equals_plain_rendering(
    name: str, conversation: list[dict[str, Any]], cuts: list[int], sep: str | None
) -> None:
    source = ACCEPTED[name]
    base: list[LoopRecord] = []
    # Requests over growing, shrinking and repeated prefixes of one conversation; the
    # message objects are shared between requests, as the conversation memo shares them.
    for cut in [*cuts, len(conversation)]:
        extra = {} if sep is None else {"sep": sep}
        reference, (text, records) = _render_both(
            source, _context(conversation[:cut], **extra), base
        )
        assert text == reference
        if not isinstance(text, str):
            continue
        for record in records:
            assert record.text[: record.ends[-1] if record.ends else 0] == record.text
            assert len(record.ends) == len(record.items)
        base = records


def test_reuse_is_by_identity_position_and_free_variables() -> None:
    source = ACCEPTED["prefix_variable"]
    loops = message_loops(source)
    conv = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    _, first = loops.render(_context(conv))
    (record,) = first
    assert record.items == conv[1:] and record.items[0] is conv[1]
    grown = [*conv, {"role": "user", "content": "q2"}]
    text, second = loops.render(_context(grown), first)
    assert text == compile_template(source).render(**_context(grown))
    assert second[0].text.startswith(record.text)  # the two old outputs were reused
    # Equal but not identical messages are rendered again (identity is the proof).
    copies = [dict(m) for m in grown]
    text, third = loops.render(_context(copies), second)
    assert text == compile_template(source).render(**_context(copies))
    # A different system prompt changes the free variable ``prefix``: nothing reused.
    changed = [{"role": "system", "content": "T"}, *grown[1:]]
    text, _ = loops.render(_context(changed), second)
    assert text == compile_template(source).render(**_context(changed))
    assert "T|q1" in text


def test_a_message_holding_the_separator_is_still_exact() -> None:
    source = ACCEPTED["position"]
    conv = [
        {"role": "user", "content": "\x00kvroute-message-loop\x01"},
        {"role": "assistant", "content": "x\x00kvroute-message-loop\x01y"},
    ]
    text, (record,) = message_loops(source).render(_context(conv))
    assert text == compile_template(source).render(**_context(conv))
    assert record.ends[0] == len(compile_template(source).render(**_context(conv[:1]))) - 5


def test_iterables_other_than_lists_fall_back() -> None:
    source = "{% for m in messages | reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(LoopFallback):
        message_loops(source).render(_context([{"role": "user", "content": "x"}]))


def test_free_variables_that_are_not_plain_data_fall_back() -> None:
    source = ACCEPTED["kwarg_in_body"]
    with pytest.raises(LoopFallback):
        message_loops(source).render(_context([{"role": "user", "content": "x"}], sep=object()))


def test_a_free_variable_that_comes_and_goes_is_never_reused_across() -> None:
    source = ACCEPTED["kwarg_in_body"]
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    base: list[LoopRecord] = []
    for sep in (None, "|", None, "||", "||", None):
        context = _context(conv) if sep is None else _context(conv, sep=sep)
        text, base = message_loops(source).render(context, base)
        assert text == compile_template(source).render(**context)


@pytest.mark.parametrize("name", sorted({**ACCEPTED, **REFUSED}.keys() - {"random"}))
def test_render_template_is_template_render(name: str) -> None:
    """``render_template`` (which the loop memo renders with) gives what ``render``
    gives: same text, the context's variables over the globals, the same errors."""
    template = compile_template({**ACCEPTED, **REFUSED}[name])
    for conversation in ([{"role": "user", "content": "q"}],
                         [{"role": "assistant", "content": "a"},
                          {"role": "user", "content": "q"}]):
        context = _context(conversation, sep="|")
        before = dict(context)
        try:
            expected: object = template.render(context)
        except Exception as exc:  # noqa: BLE001
            expected = (type(exc), str(exc))
        try:
            got: object = render_template(template, context)
        except Exception as exc:  # noqa: BLE001
            got = (type(exc), str(exc))
        assert got == expected
        assert context == before
    shadowing = compile_template("{{ raise_exception }}|{{ range(2) | list }}")
    assert render_template(shadowing, {"raise_exception": "mine"}) == "mine|[0, 1]"
    failing = compile_template("{{ raise_exception('no: ' ~ x) }}")
    with pytest.raises(jinja2.TemplateError, match="no: 1"):
        render_template(failing, {"x": 1})
