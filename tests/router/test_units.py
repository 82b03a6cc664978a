"""Unit tests of the small values: backoff, load accounting, the shipped policies."""

from __future__ import annotations

import asyncio
import random

import pytest

from aio.backoff import Backoff
from kvkeys.types import ReplicaId
from router.load import LoadTracker, ReplicaLoad
from router.load_policies import LeastLoaded, RandomPolicy, RoundRobin
from router.policy import RouteRequest

R1, R2, R3 = ReplicaId("r1"), ReplicaId("r2"), ReplicaId("r3")
REQ = RouteRequest(request_id="x", endpoint="chat", path="/v1/chat/completions", model="m",
                   body={}, session_key=None)


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(0, 0.0), (1, 0.01), (2, 0.02), (3, 0.04), (4, 0.05), (100, 0.05)],
)
def test_backoff_doubles_and_caps(failures: int, expected: float) -> None:
    assert Backoff(base_s=0.01, cap_s=0.05).compute(failures) == pytest.approx(expected)


def test_backoff_jitter_is_bounded_and_seeded() -> None:
    a = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(7))
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(7))
    values = [a.compute(3) for _ in range(50)]
    assert values == [b.compute(3) for _ in range(50)]
    assert all(0.2 <= v <= 0.4 for v in values)
    assert len(set(values)) > 1


def test_backoff_attempts_and_validation() -> None:
    backoff = Backoff(max_attempts=3)
    assert [backoff.may_retry(n) for n in (1, 2, 3)] == [True, True, False]
    assert Backoff(base_s=0).compute(5) == 0.0
    with pytest.raises(ValueError):
        Backoff(max_attempts=0)
    with pytest.raises(ValueError):
        Backoff(base_s=-1)


async def test_lease_accounting_phases() -> None:
    load = LoadTracker([R1])
    async with load.lease(R1, 100) as lease:
        assert load.get(R1) == ReplicaLoad(in_flight=1, queued_prefill_tokens=100, decoding=0)
        lease.first_byte()
        lease.first_byte()  # idempotent
        assert load.get(R1) == ReplicaLoad(in_flight=1, queued_prefill_tokens=0, decoding=1)
    assert load.get(R1) == ReplicaLoad()
    assert load.get(R2) == ReplicaLoad()  # unknown replica reads as idle


async def test_lease_returns_on_error_and_cancel() -> None:
    load = LoadTracker()
    with pytest.raises(RuntimeError):
        async with load.lease(R1, 10):
            raise RuntimeError("boom")
    assert load.snapshot() == {R1: ReplicaLoad()}

    started = asyncio.Event()

    async def hold() -> None:
        async with load.lease(R1, 10) as lease:
            lease.first_byte()
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(hold())
    await started.wait()
    assert load.in_flight(R1) == 1 and load.total_in_flight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert load.get(R1) == ReplicaLoad()
    lease = load.lease(R1, 5)
    lease.release()  # never entered: nothing to return
    assert load.get(R1) == ReplicaLoad()


def test_lease_as_a_plain_context_manager() -> None:
    """The proxy's form (``with``, no coroutine): same accounting, returned on error."""
    load = LoadTracker([R1])
    with load.lease(R1, 100) as lease:
        assert load.get(R1) == ReplicaLoad(in_flight=1, queued_prefill_tokens=100, decoding=0)
        lease.first_byte()
        assert load.get(R1) == ReplicaLoad(in_flight=1, queued_prefill_tokens=0, decoding=1)
    assert load.get(R1) == ReplicaLoad()
    with pytest.raises(RuntimeError), load.lease(R1, 10):
        assert load.get(R1).queued_prefill_tokens == 10
        raise RuntimeError("boom")
    assert load.get(R1) == ReplicaLoad()


async def test_round_robin_rotates_failover_order() -> None:
    policy = RoundRobin()
    orders = [(await policy.route(REQ, [R1, R2, R3])).replicas for _ in range(4)]
    assert orders == [(R1, R2, R3), (R2, R3, R1), (R3, R1, R2), (R1, R2, R3)]


async def test_least_loaded_prefers_idle_and_rotates_ties() -> None:
    load = LoadTracker([R1, R2, R3])
    policy = LeastLoaded(load)
    async with load.lease(R1), load.lease(R1), load.lease(R2):
        decision = await policy.route(REQ, [R1, R2, R3])
        assert decision.replicas == (R3, R2, R1)
        assert decision.reason == "least_in_flight"
    firsts = {(await policy.route(REQ, [R1, R2, R3])).replica for _ in range(3)}
    assert firsts == {R1, R2, R3}


async def test_random_is_seeded_permutation() -> None:
    a = RandomPolicy(random.Random(1))
    b = RandomPolicy(random.Random(1))
    got = [(await a.route(REQ, [R1, R2, R3])).replicas for _ in range(10)]
    assert got == [(await b.route(REQ, [R1, R2, R3])).replicas for _ in range(10)]
    assert all(sorted(o) == [R1, R2, R3] for o in got)
    assert len(set(got)) > 1
