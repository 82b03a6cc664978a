"""The session policy: consistent-hash affinity only, with the stickiness counter."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from kvkeys.types import ReplicaId
from router.metrics import KvMetrics
from router.policy import RouteRequest
from router.session_policy import SessionPolicy

R = [ReplicaId(f"r{i}") for i in range(4)]


def req(body: dict[str, Any] | None, session: str | None = None, rid: str = "q") -> RouteRequest:
    return RouteRequest(rid, "chat", "/v1/chat/completions", "m", body, session)


def chat(*turns: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "shared"}]
            + [{"role": "user", "content": t} for t in turns]}


async def test_pins_sessions_and_counts_later_turns() -> None:
    prom = CollectorRegistry()
    p = SessionPolicy(metrics=KvMetrics(prom))
    d1 = await p.route(req(chat("a"), session="s1"), R)
    d2 = await p.route(req(chat("a", "b"), session="s1"), R)
    assert d1.replicas == d2.replicas and sorted(d1.replicas) == sorted(R)
    assert d1.reason == "session" and not d1.want_usage and d1.predicted_cached_tokens is None
    assert prom.get_sample_value("router_session_turns_total",
                                 {"policy": "session", "placement": "same_replica"}) == 1
    # the replica leaves: only its sessions move
    rest = [r for r in R if r != d1.replica]
    d3 = await p.route(req(chat("a", "b", "c"), session="s1"), rest)
    assert d3.replica == d1.replicas[1]
    assert prom.get_sample_value("router_session_turns_total",
                                 {"policy": "session", "placement": "moved"}) == 1


async def test_keys_without_a_session_header() -> None:
    p = SessionPolicy()
    alice = [await p.route(req(chat("alice here", *["x"] * i)), R) for i in range(3)]
    assert len({d.replica for d in alice}) == 1 and alice[0].reason == "first_message"
    spread = {(await p.route(req(chat(f"user {i}")), R)).replica
              for i in range(40)}
    assert spread == set(R)  # a shared system prompt does not pin everyone to one replica
    no_key = await p.route(req(None, rid="abc"), R)
    assert no_key.reason == "request_id" and len(p.sessions) == 1 + 40
    p.record(req(None), no_key, None)  # type: ignore[arg-type]
