"""Trace JSONL: round trip, stable bytes, errors that name the line, history building."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import trace as trace_mod
from bench.trace import TraceRequest
from bench.workload import generate, preset


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    trace = generate(preset("small", sessions=5, tenants=2, salted=True, model="m"))
    path = tmp_path / "t.jsonl"
    trace_mod.save(trace, path)
    loaded = trace_mod.load(path)
    assert loaded == trace
    assert path.read_text() == trace_mod.dumps(loaded)
    assert len(path.read_text().splitlines()) == len(trace)


def test_explicit_messages_round_trip() -> None:
    r = TraceRequest(
        session="x", turn=1, at=0.0, user="", max_tokens=4,
        messages=({"role": "user", "content": "hi"},),
    )
    assert trace_mod.loads(trace_mod.dumps([r])) == [r]


def test_bad_lines_name_the_line_number() -> None:
    good = trace_mod.dumps([TraceRequest(session="a", turn=1, at=0, user="u", max_tokens=1)])
    with pytest.raises(ValueError, match="line 2"):
        trace_mod.loads(good + '{"session": "a"}\n')
    with pytest.raises(ValueError, match="line 1"):
        trace_mod.loads('{"session": "a", "turn": 0, "at": 0, "user": "", "max_tokens": 1}\n')


def test_conversation_uses_returned_replies_else_fixed_ones() -> None:
    turns = [
        TraceRequest(session="a", turn=1, at=0, user="u1", max_tokens=1, system="sys", reply="f1"),
        TraceRequest(session="a", turn=2, at=1, user="u2", max_tokens=1, reply="f2"),
        TraceRequest(session="a", turn=3, at=2, user="u3", max_tokens=1, reply="f3"),
    ]
    fixed = list(trace_mod.conversation(turns))
    assert fixed[2] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "f1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "f2"},
        {"role": "user", "content": "u3"},
    ]
    replies: list[str] = []
    live = trace_mod.conversation(turns, replies)
    first = next(live)
    assert first[-1] == {"role": "user", "content": "u1"}
    replies.append("real1")
    second = next(live)
    assert second[2] == {"role": "assistant", "content": "real1"}
    # each prompt is an append-only extension of the previous one
    for a, b in zip(fixed, fixed[1:], strict=False):
        assert b[: len(a)] == a
