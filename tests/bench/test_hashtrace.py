"""Importing block-hash traces (aiperf / Dynamo / Mooncake JSONL, ``bench.hashtrace``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.hashtrace import (
    HashScale,
    block_token_ids,
    import_records,
    load_hash_trace,
    parse_hash_trace,
    to_trace,
    token_ids,
)
from bench.trace import conversation, dumps, loads

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_head300.jsonl"


def test_equal_hash_ids_give_equal_aligned_blocks() -> None:
    text = "\n".join([
        '{"timestamp": 0, "input_length": 1100, "output_length": 100, "hash_ids": [7, 8, 9]}',
        '{"timestamp": 800, "input_length": 1000, "output_length": 20, "hash_ids": [7, 8, 5]}',
    ])
    scale = HashScale(block_tokens=32)
    a, b = import_records(parse_hash_trace(text), scale)
    # 1,100 tokens x 32/512 = 68.75 -> 69 tokens: two whole blocks and 5 of the third.
    assert (a.prompt_tokens, a.output_tokens) == (69, 6)
    ta, tb = token_ids(a, scale, 1000), token_ids(b, scale, 1000)
    # 1,000 tokens would be 62.5, but three ids mean at least two whole blocks and one more.
    assert len(ta) == 69 and len(tb) == 65
    assert ta[:64] == tb[:64] and ta[64:69] != tb[64:69]
    assert ta[:32] == block_token_ids(7, 32, 1000)
    # They share 2 >= link_blocks leading ids: one conversation; the think time is the
    # gap since the first arrival, compressed 16x by default (512 / 32).
    assert (b.session, b.turn) == (a.session, 2)
    assert b.think_s == pytest.approx(0.8 / 16)


def test_session_ids_and_delays_are_kept() -> None:
    text = "\n".join([
        '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2],'
        ' "session_id": "x"}',
        '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [3, 4],'
        ' "session_id": "x", "delay": 4000}',
    ])
    a, b = import_records(parse_hash_trace(text), HashScale(block_tokens=64,
                                                             time_compression=2.0))
    assert (a.session, b.session, b.turn) == ("x", "x", 2)
    assert b.think_s == pytest.approx(2.0)


def test_bad_lines_name_the_line() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_hash_trace('{"input_length": 5}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError):
        HashScale(block_tokens=0)


def test_mooncake_slice_imports_and_replays_as_chat_turns() -> None:
    recs = load_hash_trace(SLICE)
    assert len(recs) == 300
    scale = HashScale(block_tokens=64, duration_s=100.0)
    reqs = import_records(recs, scale)
    assert len(reqs) == sum(1 for r in recs if r.timestamp_ms < 100_000)
    later = [r for r in reqs if r.turn > 1]
    assert later and all(r.think_s >= 0 for r in later)
    assert [r.at for r in reqs] == sorted(r.at for r in reqs)
    # Every request starts with the shared block 0: identical first 64 tokens.
    firsts = {tuple(token_ids(r, scale, 500)[:64]) for r in reqs}
    assert len(firsts) == 1
    words = [f"w{i}" for i in range(500)]
    trace = to_trace(reqs, scale, words, model="m")
    assert loads(dumps(trace)) == trace
    first = next(conversation([trace[0]]))
    assert first[0]["role"] == "user"
    assert len(first[0]["content"].split()) == reqs[0].prompt_tokens


def test_lines_without_hash_ids_get_stable_unique_content() -> None:
    text = '{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": []}\n' * 2
    scale = HashScale(block_tokens=16, source_block_tokens=16)
    a, b = import_records(parse_hash_trace(text), scale)
    assert a.session != b.session and a.prompt_tokens == 100
    ta = token_ids(a, scale, 1000)
    assert len(ta) == 100 and ta != token_ids(b, scale, 1000)
    # A function of the session and turn only (no per-process string hashing).
    assert ta == token_ids(a, scale, 1000)
