"""The kv-overhead benchmark's workload and replica events, without running it."""

from __future__ import annotations

import json
from pathlib import Path

from bench.kv_overhead import (
    BLOCK_SIZE,
    CONVERSATIONS,
    TAILS,
    _stored_events,
    bodies,
    component,
    stack_component,
)


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
    # A frame of no component's (a dataclass's generated __init__, the standard
    # library) counts for its nearest caller that has one.
    assert stack_component("main (kvroute:1);decide (router/kv_policy.py:3);"
                           "__init__ (<string>:2)") == "scoring"
    assert stack_component("root (<template>:1);call (jinja2/sandbox.py:2)") == "rendering"
    assert stack_component("a (elsewhere.py:1);b (enum.py:2)") == "other"


async def test_the_fake_replicas_render_like_vllm_for_the_peers() -> None:
    # vllm-router's cache_aware asks every worker's /render (then /tokenize) for token ids:
    # the fake replicas answer both over real HTTP, with ids a later turn extends.
    import asyncio

    import aiohttp

    from bench.overhead_peers import RenderingReplica, toy_token_ids
    from tests.ports import free_port

    port = free_port()
    server = await asyncio.get_running_loop().create_server(
        RenderingReplica, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        shorter = json.loads(bodies(0)[0])
        shorter["messages"] = shorter["messages"][:-2]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.post(url + "/v1/chat/completions/render",
                                 data=bodies(0)[0]) as resp:
                rendered = await resp.json()
            async with http.post(url + "/tokenize", json=shorter) as resp:
                tokenized = await resp.json()
            async with http.post(url + "/v1/chat/completions", data=bodies(0)[0]) as resp:
                chat = await resp.json()
        ids = rendered["token_ids"]
        assert ids == toy_token_ids(bodies(0)[0]) and len(ids) > 5000
        assert tokenized["count"] == len(tokenized["tokens"]) < len(ids)
        assert ids[: len(tokenized["tokens"])] == tokenized["tokens"]
        assert chat["object"] == "chat.completion"
    finally:
        server.close()
        await server.wait_closed()


def test_missing_peer_binaries_are_named(tmp_path: Path) -> None:
    import pytest

    from bench.overhead_peers import standard_peers

    with pytest.raises(SystemExit, match="pip install sglang-router vllm-router"):
        standard_peers(tmp_path)
    for exe in ("smg", "vllm-router"):
        (tmp_path / exe).write_text("")
    names = [p.name for p in standard_peers(tmp_path)]
    assert names == ["sglang cache_aware", "vllm cache_aware", "vllm consistent_hash"]


async def test_a_fake_replica_closes_what_it_cannot_parse_and_serves_on() -> None:
    import asyncio
    from typing import Any

    from bench.overhead_upstreams import ReplicaProtocol

    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    server = await loop.create_server(ReplicaProtocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # A client that opens with the HTTP/2 preface (prior knowledge), as a peer
        # router's probe does: the connection is closed, nothing else happens.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # The server goes on answering HTTP/1.1.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert errors == []
