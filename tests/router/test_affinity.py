"""Consistent-hash affinity: keys, stability, and ~1/N movement on membership change."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId
from router.affinity import AffinityRing, affinity_key
from router.policy import RouteRequest

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]


def req(body: dict[str, Any] | None, *, session: str | None = None, endpoint: str = "chat",
        rid: str = "req-1") -> RouteRequest:
    return RouteRequest(rid, endpoint, "/v1/chat/completions", "m", body, session)  # type: ignore[arg-type]


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": messages}


def test_session_key_wins() -> None:
    k = affinity_key(req(chat("s", "hi"), session="abc"))
    assert (k.key, k.source) == ("abc", "session")


def test_first_message_is_stable_across_turns_and_ignores_shared_system_prompt() -> None:
    t1 = affinity_key(req(chat("shared system", "question from alice")))
    t3 = affinity_key(req(chat("shared system", "question from alice", "answer", "more")))
    bob = affinity_key(req(chat("shared system", "question from bob")))
    assert t1.source == "first_message"
    assert t1.key == t3.key != bob.key


def test_prompt_prefix_from_block_keys_then_text_then_request_id() -> None:
    keys = block_keys(list(range(200)), 16, model="m")
    k = affinity_key(req({"prompt": "x"}, endpoint="completions"), keys, prefix_blocks=4)
    assert (k.key, k.source) == (f"b{keys[3]:x}", "prompt_prefix")
    short = affinity_key(req({"prompt": "x"}, endpoint="completions"), keys[:2], prefix_blocks=4)
    assert short.key == f"b{keys[1]:x}"
    a = affinity_key(req({"prompt": "hello" * 10}, endpoint="completions"))
    b = affinity_key(req({"prompt": ["hello" * 10]}, endpoint="completions"))
    t = affinity_key(req({"prompt": [1, 2, 3]}, endpoint="completions"))
    assert a.source == t.source == "prompt_prefix" and a.key == b.key != t.key
    none = affinity_key(req(None, rid="r-9"))
    assert (none.key, none.source) == ("r-9", "request_id")
    odd = affinity_key(req({"messages": [{"role": "system", "content": "s"}]}, rid="r-8"))
    assert odd.source == "request_id"


def test_ring_is_deterministic_and_spreads() -> None:
    ring = AffinityRing()
    keys = [f"s{i}" for i in range(4000)]
    placed = [ring.first(k, REPLICAS) for k in keys]
    other = AffinityRing()
    assert placed == [other.first(k, REPLICAS) for k in keys]
    counts = collections.Counter(placed)
    assert set(counts) == set(REPLICAS)
    assert min(counts.values()) > 4000 / 4 * 0.75


@pytest.mark.parametrize("n", [3, 4, 8])
def test_adding_a_replica_moves_about_one_nth_and_only_to_it(n: int) -> None:
    ring = AffinityRing()
    before = [ReplicaId(f"r{i}") for i in range(n)]
    after = [*before, ReplicaId("new")]
    keys = [f"session-{i}" for i in range(6000)]
    moved = [k for k in keys if ring.first(k, before) != ring.first(k, after)]
    share = len(moved) / len(keys)
    assert abs(share - 1 / (n + 1)) < 0.06
    assert all(ring.first(k, after) == "new" for k in moved)


def test_removing_a_replica_moves_only_its_sessions() -> None:
    ring = AffinityRing()
    keys = [f"session-{i}" for i in range(6000)]
    gone = REPLICAS[2]
    rest = [r for r in REPLICAS if r != gone]
    for k in keys:
        was = ring.first(k, REPLICAS)
        now = ring.first(k, rest)
        if was != gone:
            assert now == was
        else:
            # they go where the ring order says they would go next
            assert now == ring.order(k, REPLICAS)[1]


def test_order_and_preference() -> None:
    ring = AffinityRing()
    order = ring.order("k", REPLICAS)
    assert sorted(order) == sorted(REPLICAS) and order[0] == ring.first("k", REPLICAS)
    assert ring.order("k", REPLICAS, size=2) == order[:2]
    assert ring.preference("k", REPLICAS) == {r: i for i, r in enumerate(order)}
    assert ring.order("k", [REPLICAS[1]]) == [REPLICAS[1]]
    assert ring.first("k", [REPLICAS[1]]) == REPLICAS[1]


def test_ring_cache_is_bounded() -> None:
    ring = AffinityRing(max_rings=2)
    for i in range(5):
        ring.first("k", REPLICAS[: 1 + (i % 3) + 1])
    assert len(ring._rings) <= 2


def test_remembered_orders_are_the_rings_and_bounded() -> None:
    ring = AffinityRing(max_orders=3)
    keys = [f"session-{i}" for i in range(10)]
    first = {k: ring.order(k, REPLICAS) for k in keys}
    assert len(ring._orders) == 3
    for k in keys:  # from the cache or walked again, the same order
        assert ring.order(k, list(reversed(REPLICAS))) == first[k]
        assert ring.order(k, REPLICAS) == AffinityRing().order(k, REPLICAS)
    ring.order(keys[0], REPLICAS).clear()  # callers get their own list
    assert ring.order(keys[0], REPLICAS) == first[keys[0]]
