"""The kv-overhead benchmark's workload and replica events, without running it."""

from __future__ import annotations

import json
from pathlib import Path

from bench.kv_overhead import BLOCK_SIZE, CONVERSATIONS, TAILS, _stored_events, bodies, component


def test_bodies_are_next_turns_of_ten_turn_conversations() -> None:
    first = [json.loads(b) for b in bodies(0)]
    assert len(first) == TAILS and all(20_000 < len(b) < 32_000 for b in bodies(0))
    history = first[0]["messages"][:-1]
    assert len(history) == 21 and sum(m["role"] == "user" for m in history) == 10
    assert all(b["messages"][:-1] == history for b in first)  # one history, new tails
    assert len({b["messages"][-1]["content"] for b in first}) == TAILS
    assert json.loads(bodies(1)[0])["messages"][0] != history[0]


def test_each_replica_publishes_the_blocks_of_its_conversations(llama3_dir: Path) -> None:
    events = _stored_events(2, str(llama3_dir))
    assert all(events)
    for per_replica in events:
        starts = [e for e in per_replica if e.parent_block_hash is None]
        assert len(starts) == CONVERSATIONS // 2  # one chain per conversation held
        assert all(len(e.token_ids) == BLOCK_SIZE for e in per_replica)
        hashes = [e.block_hashes[0] for e in per_replica]
        assert len(set(hashes)) == len(hashes)
        chained = {e.block_hashes[0] for e in per_replica}
        assert all(e.parent_block_hash is None or e.parent_block_hash in chained
                   for e in per_replica)


def test_profile_frames_are_grouped_by_component() -> None:
    assert component("render (prompt/render.py:10)") == "rendering"
    assert component("lookup (index/memory.py:1)") == "index"
    assert component("send (uvicorn/protocols/http/httptools_impl.py:5)") == "HTTP server"
    assert component("request (aiohttp/client.py:5)") == "upstream client"
    assert component("decide (router/kv_policy.py:3)") == "scoring"
    assert component("parse_body (router/request.py:116)") == "JSON + request parsing"
    assert component("mystery (elsewhere.py:1)") == "other"
