"""The runner against a fake OpenAI-compatible endpoint on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from bench.runner import RequestResult, RunConfig, Runner
from bench.trace import TraceRequest
from tests.loopback_app import serve_app


class FakeEndpoint:
    """Streams a fixed reply after a delay; remembers every body it got and when."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.times: list[float] = []
        self.fail_turn: int | None = None
        self.router_headers = True

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.times.append(time.perf_counter())
        n_user = sum(m["role"] == "user" for m in body["messages"])
        if n_user == self.fail_turn:
            return web.json_response({"error": {"message": "boom"}}, status=503)
        await asyncio.sleep(self.delay_s)
        headers = {"Content-Type": "text/event-stream"}
        if self.router_headers:
            headers.update({"x-kvroute-replica": f"r{n_user % 2}", "x-kvroute-reason": "test",
                            "x-kvroute-predicted-cached-tokens": "32"})
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        for piece in ("", f"reply{n_user}", " done"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 100 * n_user, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 16 * (n_user - 1)},
                 "kvroute_sim": {"ttft_s": 0.123, "replica": "http://127.0.0.1:1"}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[str, FakeEndpoint]]:
    fake = FakeEndpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    async with serve_app(app) as url:
        yield url, fake


def two_sessions() -> list[TraceRequest]:
    out = []
    for s, start in (("a", 0.0), ("b", 0.5)):
        for turn in (1, 2, 3):
            out.append(TraceRequest(
                session=s, turn=turn, at=start + turn, think_s=0.0 if turn == 1 else 1.0,
                user=f"{s} question {turn}", max_tokens=8, reply=f"fixed{turn}",
                system="sys" if turn == 1 else None, cache_salt="salty" if s == "b" else None,
            ))
    return out


async def test_open_loop_replay_records_everything(endpoint: tuple[str, FakeEndpoint]) -> None:
    url, fake = endpoint
    cfg = RunConfig(url=url, model="m", time_scale=0.1, headers={"X-KVRoute-Policy": "kv"})
    seen: list[RequestResult] = []
    async with Runner(cfg) as runner:
        results = await runner.run(two_sessions(), progress=seen.append)
    assert len(results) == 6 and seen == results and all(r.ok for r in results)
    by = {(r.session, r.turn): r for r in results}
    r = by[("a", 3)]
    assert r.replica == "r1" and r.reason == "test" and r.predicted_cached_tokens == 32
    assert r.prompt_tokens == 300 and r.cached_tokens == 32 and r.sim_ttft_s == 0.123
    assert r.ttft_s is not None and r.latency_s is not None and r.ttft_s <= r.latency_s
    assert r.ttft_s >= fake.delay_s
    # session b starts 0.5 trace s = 0.05 wall s after a
    assert by[("b", 1)].sent_s - by[("a", 1)].sent_s == pytest.approx(0.05, abs=0.03)
    # turn 2 is sent think time (0.1 wall s) after turn 1's reply ended, not at a fixed time
    a1, a2 = by[("a", 1)], by[("a", 2)]
    assert a2.sent_s - (a1.sent_s + (a1.latency_s or 0)) == pytest.approx(0.1, abs=0.03)
    # histories carry the trace's fixed replies; headers and salt are sent
    last_a = [b for b in fake.bodies if b["messages"][1]["content"] == "a question 1"][-1]
    assert [m["content"] for m in last_a["messages"]] == [
        "sys", "a question 1", "fixed1", "a question 2", "fixed2", "a question 3"]
    assert all(b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert sum(b.get("cache_salt") == "salty" for b in fake.bodies) == 3
    assert all(h["X-KVRoute-Policy"] == "kv" for h in fake.headers)
    assert {h["X-Session-ID"] for h in fake.headers} == {"a", "b"}


async def test_actual_replies_and_errors(endpoint: tuple[str, FakeEndpoint]) -> None:
    url, fake = endpoint
    fake.fail_turn = 2
    fake.router_headers = False  # e.g. a peer router: the replica's own report names it
    trace = [t for t in two_sessions() if t.session == "a"]
    async with Runner(RunConfig(url=url, model="m", time_scale=0.01, replies="actual")) as r:
        results = await r.run(trace)
    assert [x.ok for x in sorted(results, key=lambda x: x.turn)] == [True, False, True]
    assert all(x.replica == "127.0.0.1:1" and x.reason is None for x in results if x.ok)
    failed = next(x for x in results if not x.ok)
    assert failed.status == 503 and failed.error and "boom" in failed.error
    last = fake.bodies[-1]["messages"]
    # turn 1's real reply; turn 2 failed, so the fixed reply stands in
    assert [m["content"] for m in last if m["role"] == "assistant"] == ["reply1 done", "fixed2"]


async def test_connection_refused_is_recorded() -> None:
    trace = two_sessions()[:1]
    async with Runner(RunConfig(url="http://127.0.0.1:9", model="m", time_scale=0.01,
                                connect_timeout_s=1)) as r:
        results = await r.run(trace)
    assert results[0].status == 0 and results[0].error
