"""The ``KVIndex`` contract, run against every backend (in memory; real Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.store import AddByEngineKeyOp, AddOp, ClearOp, EvictOp, KVIndex
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaHit, ReplicaId, RequestKey

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def make_memory() -> KVIndex:
    return InMemoryIndex()


def make_redis(url: str, namespace: str) -> KVIndex:
    return RedisIndex.from_url(url, key_prefix=namespace, op_timeout_s=2.0)


@pytest.fixture(params=["memory", "redis"])
async def index(
    request: pytest.FixtureRequest, redis_url: str, redis_namespace: str
) -> AsyncIterator[KVIndex]:
    idx = make_memory() if request.param == "memory" else make_redis(redis_url, redis_namespace)
    try:
        yield idx
    finally:
        await idx.aclose()


def chain(n: int, seed: int = 0, *, salt: str | None = None) -> list[RequestKey]:
    return block_keys([seed * 1000 + i for i in range(n * 4)], 4, model="m", cache_salt=salt)


def engine(keys: list[RequestKey], tag: int = 1) -> list[EngineKey]:
    return [EngineKey((k ^ (tag * 0x9E3779B97F4A7C15)) & (2**64 - 1)) for k in keys]


async def test_empty_lookups(index: KVIndex) -> None:
    assert await index.lookup([]) == PrefixHits()
    assert await index.lookup(chain(5)) == PrefixHits()
    assert await index.lookup(chain(5), among=[A]) == PrefixHits()
    assert await index.replicas() == set()
    assert await index.request_key(A, EngineKey(1)) is None
    assert await index.request_keys(A, [EngineKey(1), EngineKey(2)]) == [None, None]


async def test_longest_prefix_stops_at_first_miss(index: KVIndex) -> None:
    keys = chain(10)
    await index.add(A, engine(keys[:6]), keys[:6])
    # B holds blocks 0-2 and 4-9 but not 3: its run stops at 3 (keys are chained).
    b_keys = keys[:3] + keys[4:]
    await index.add(B, engine(b_keys, 2), b_keys)
    hits = await index.lookup(keys)
    assert hits.by_replica == {A: ReplicaHit(6), B: ReplicaHit(3)}
    assert hits.best() == 6
    assert hits.blocks(C) == 0
    assert (await index.lookup(keys[1:])).by_replica == {A: ReplicaHit(5), B: ReplicaHit(2)}
    # A prompt whose first block nobody holds has no hits at all.
    assert await index.lookup(chain(3, seed=9) + keys) == PrefixHits()
    assert await index.replicas() == {A, B}


async def test_among_restricts_the_answer(index: KVIndex) -> None:
    keys = chain(4)
    for r in (A, B, C):
        await index.add(r, engine(keys), keys)
    hits = await index.lookup(keys, among=[A, C, ReplicaId("unknown")])
    assert hits.by_replica == {A: ReplicaHit(4), C: ReplicaHit(4)}
    assert await index.lookup(keys, among=[]) == PrefixHits()


async def test_evicting_unknown_keys_and_replicas_is_harmless(index: KVIndex) -> None:
    keys = chain(3)
    await index.evict(A, [EngineKey(42)])
    await index.add(A, engine(keys), keys)
    await index.evict(A, [EngineKey(42), EngineKey(43)])
    await index.evict(A, engine(keys), Medium.CPU)  # held on GPU only
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(3)}


async def test_clear_unknown_replica_is_harmless(index: KVIndex) -> None:
    await index.clear(ReplicaId("never-seen"))
    keys = chain(3)
    await index.add(A, engine(keys), keys)
    await index.clear(B)
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(3)}


async def test_clear_forgets_one_replica_only(index: KVIndex) -> None:
    keys = chain(5)
    await index.add(A, engine(keys), keys)
    await index.add(B, engine(keys, 2), keys)
    await index.add(A, engine(keys[:2]), keys[:2], Medium.CPU)
    await index.clear(A)
    assert (await index.lookup(keys)).by_replica == {B: ReplicaHit(5)}
    assert await index.request_key(A, engine(keys)[0]) is None
    assert await index.replicas() == {B}
    await index.add(A, engine(keys[:1]), keys[:1])
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(1), B: ReplicaHit(5)}


async def test_duplicate_adds_are_reference_counted(index: KVIndex) -> None:
    keys = chain(2)
    eks = engine(keys)
    await index.add(A, eks, keys)
    await index.add(A, eks, keys)  # vLLM stored the same content twice
    await index.evict(A, eks)
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(2)}
    await index.evict(A, eks)
    assert await index.lookup(keys) == PrefixHits()
    await index.evict(A, eks)  # one removal too many: ignored
    await index.add(A, eks, keys)
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(2)}


async def test_two_engine_keys_for_one_request_key(index: KVIndex) -> None:
    keys = chain(1)
    await index.add(A, [EngineKey(1)], keys)
    await index.add(A, [EngineKey(2)], keys)
    await index.evict(A, [EngineKey(1)])
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(1)}
    await index.evict(A, [EngineKey(2)])
    assert await index.lookup(keys) == PrefixHits()


async def test_engine_key_reused_for_other_content(index: KVIndex) -> None:
    old, new = chain(1, seed=1), chain(1, seed=2)
    await index.add(A, [EngineKey(7)], old)
    await index.add(A, [EngineKey(7)], new)
    assert await index.request_key(A, EngineKey(7)) == new[0]
    assert await index.lookup(old) == PrefixHits()
    assert (await index.lookup(new)).by_replica == {A: ReplicaHit(1)}


async def test_tiers(index: KVIndex) -> None:
    keys = chain(6)
    # A: everything on GPU.  B: only in CPU memory.  C: 2 on GPU, 2 in CPU, 1 in storage.
    await index.add(A, engine(keys), keys)
    await index.add(B, engine(keys, 2), keys, Medium.CPU)
    await index.add(C, engine(keys[:2], 3), keys[:2])
    await index.add(C, engine(keys[2:4], 3), keys[2:4], Medium.CPU)
    await index.add(C, engine(keys[4:5], 3), keys[4:5], Medium.STORAGE)
    hits = await index.lookup(keys)
    assert hits.by_replica == {
        A: ReplicaHit(6),
        B: ReplicaHit(0, 6),
        C: ReplicaHit(2, 2, 1),
    }
    assert hits.by_replica[C].blocks == 5
    # The fastest tier counts when a block is held in several.
    await index.add(B, engine(keys[:1], 2), keys[:1], Medium.GPU)
    assert (await index.lookup(keys)).by_replica[B] == ReplicaHit(1, 5)


async def test_offload_store_by_engine_key_survives_gpu_removal(index: KVIndex) -> None:
    keys = chain(3)
    eks = engine(keys)
    await index.add(A, eks, keys)
    assert await index.add_by_engine_key(A, eks[:2] + [EngineKey(99)], Medium.CPU) == 2
    assert await index.add_by_engine_key(B, eks, Medium.CPU) == 0
    await index.evict(A, eks, Medium.GPU)  # GPU eviction keeps the CPU copy
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(0, 2)}
    assert await index.request_key(A, eks[0]) == keys[0]
    assert await index.request_key(A, eks[2]) is None
    await index.evict(A, eks[:2], Medium.CPU)
    assert await index.lookup(keys) == PrefixHits()
    assert await index.request_key(A, eks[0]) is None


async def test_request_keys_continue_chains(index: KVIndex) -> None:
    keys = chain(3)
    eks = engine(keys)
    await index.add(A, eks, keys)
    assert await index.request_key(A, eks[1]) == keys[1]
    assert await index.request_keys(A, [eks[2], EngineKey(5), eks[0]]) == [keys[2], None, keys[0]]
    assert await index.request_key(B, eks[1]) is None


async def test_apply_runs_ops_in_order(index: KVIndex) -> None:
    keys = chain(4)
    eks = engine(keys)
    await index.apply(
        A,
        [
            AddOp(eks[:2], keys[:2]),
            ClearOp(),
            AddOp(eks, keys),
            AddByEngineKeyOp(eks[:1], Medium.STORAGE),
            EvictOp(eks[3:], Medium.GPU),
            EvictOp([EngineKey(12345)]),
        ],
    )
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(3)}
    await index.apply(A, [EvictOp(eks[:1])])
    assert (await index.lookup(keys)).by_replica == {A: ReplicaHit(2, 0, 1)}
    await index.apply(A, [])


async def test_salted_chains_do_not_meet(index: KVIndex) -> None:
    plain, salted = chain(3), chain(3, salt="tenant")
    await index.add(A, engine(salted), salted)
    assert await index.lookup(plain) == PrefixHits()
    assert (await index.lookup(salted)).by_replica == {A: ReplicaHit(3)}


async def test_concurrent_add_and_lookup(index: KVIndex) -> None:
    """Lookups racing with adds see each add entirely or not at all."""
    replicas = [ReplicaId(f"r{i}") for i in range(8)]
    keys = chain(40)

    async def writer(r: ReplicaId, i: int) -> None:
        await asyncio.sleep(0)
        await index.add(r, engine(keys, i + 1), keys)

    seen: list[PrefixHits] = []

    async def reader() -> None:
        for _ in range(20):
            seen.append(await index.lookup(keys))
            await asyncio.sleep(0)

    await asyncio.gather(reader(), *(writer(r, i) for i, r in enumerate(replicas)), reader())
    for hits in seen:
        assert all(h == ReplicaHit(40) for h in hits.by_replica.values())
    final = await index.lookup(keys)
    assert final.by_replica == {r: ReplicaHit(40) for r in replicas}
    assert await index.replicas() == set(replicas)


class _Model:
    """The contract in a few lines, for random comparison: per replica, engine key ->
    (request key, reference count per tier)."""

    def __init__(self) -> None:
        self.engine: dict[ReplicaId, dict[EngineKey, tuple[RequestKey, list[int]]]] = {}

    def add(self, r: ReplicaId, ek: EngineKey, rk: RequestKey, tier: int) -> None:
        held = self.engine.setdefault(r, {})
        entry = held.get(ek)
        if entry is None or entry[0] != rk:
            entry = held[ek] = (rk, [0, 0, 0])
        entry[1][tier] += 1

    def add_known(self, r: ReplicaId, ek: EngineKey, tier: int) -> None:
        entry = self.engine.get(r, {}).get(ek)
        if entry is not None:
            entry[1][tier] += 1

    def evict(self, r: ReplicaId, ek: EngineKey, tier: int) -> None:
        held = self.engine.get(r, {})
        entry = held.get(ek)
        if entry is not None and entry[1][tier] > 0:
            entry[1][tier] -= 1
            if not any(entry[1]):
                del held[ek]

    def lookup(self, keys: list[RequestKey]) -> dict[ReplicaId, ReplicaHit]:
        out: dict[ReplicaId, ReplicaHit] = {}
        for r, held in self.engine.items():
            per_tier = [0, 0, 0]
            for key in keys:
                tiers = [any(rk == key and c[t] for rk, c in held.values()) for t in range(3)]
                if not any(tiers):
                    break
                per_tier[tiers.index(True)] += 1
            if any(per_tier):
                out[r] = ReplicaHit(*per_tier)
        return out


async def test_random_operations_match_the_model(index: KVIndex) -> None:
    import random

    tiers = [Medium.GPU, Medium.CPU, Medium.STORAGE]
    keys = chain(5)
    for case in range(120):
        rng = random.Random(case)
        model = _Model()
        replicas = [A, B, C]
        for _ in range(rng.randrange(1, 25)):
            r, t = rng.choice(replicas), rng.randrange(3)
            eks = [EngineKey(rng.randrange(8)) for _ in range(rng.randrange(1, 4))]
            kind = rng.random()
            if kind < 0.5:
                rks = [rng.choice(keys[: rng.randrange(1, 6)]) for _ in eks]
                await index.apply(r, [AddOp(eks, rks, tiers[t])])
                for ek_, rk in zip(eks, rks, strict=True):
                    model.add(r, ek_, rk, t)
            elif kind < 0.65:
                await index.apply(r, [AddByEngineKeyOp(eks, tiers[t])])
                for ek_ in eks:
                    model.add_known(r, ek_, t)
            elif kind < 0.95:
                await index.apply(r, [EvictOp(eks, tiers[t])])
                for ek_ in eks:
                    model.evict(r, ek_, t)
            else:
                await index.apply(r, [ClearOp()])
                model.engine.pop(r, None)
            assert (await index.lookup(keys)).by_replica == model.lookup(keys), case
        for r in replicas:
            await index.clear(r)
