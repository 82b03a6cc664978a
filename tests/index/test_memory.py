"""InMemoryIndex specifics: replica capacity growth, the prefix scan against a reference."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from index.masks import holder_mask, scan_masks, scan_runs
from index.memory import InMemoryIndex
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaHit, ReplicaId, RequestKey


def chain(n: int) -> list[RequestKey]:
    return block_keys(list(range(4 * n)), 4, model="m")


async def test_more_replicas_than_the_initial_stride() -> None:
    idx = InMemoryIndex(stride=4)
    keys = chain(3)
    replicas = [ReplicaId(f"r{i}") for i in range(11)]
    for i, r in enumerate(replicas):
        medium = Medium.CPU if i % 3 == 1 else Medium.STORAGE if i % 3 == 2 else Medium.GPU
        idx.add_sync(r, [EngineKey(1000 * i + j) for j in range(i % 3 + 1)], keys[: i % 3 + 1],
                     medium)  # fmt: skip
    want = {
        r: ReplicaHit(n if i % 3 == 0 else 0, n if i % 3 == 1 else 0, n if i % 3 == 2 else 0)
        for i, r in enumerate(replicas)
        for n in [i % 3 + 1]
    }
    assert (await idx.lookup(keys)).by_replica == want
    assert idx.lookup_sync(keys, among=replicas[9:]) == PrefixHits(
        {r: want[r] for r in replicas[9:]}
    )
    assert idx.blocks(replicas[2]) == 3 and idx.blocks(ReplicaId("nobody")) == 0
    idx.clear_sync(replicas[0])
    assert replicas[0] not in (await idx.lookup(keys)).by_replica
    await idx.aclose()
    assert await idx.replicas() == set()


def reference(values: list[int], allowed: int, stride: int, n_ids: int) -> dict[int, ReplicaHit]:
    out: dict[int, ReplicaHit] = {}
    for b in range(n_ids):
        if not allowed >> b & 1:
            continue
        g = c = s = 0
        for v in values:
            if v >> b & 1:
                g += 1
            elif v >> (stride + b) & 1:
                c += 1
            elif v >> (2 * stride + b) & 1:
                s += 1
            else:
                break
        if g + c + s:
            out[b] = ReplicaHit(g, c, s)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(0, (1 << (3 * 8)) - 1), min_size=0, max_size=30),
            st.integers(0, (1 << 8) - 1),
            st.booleans(),
        )
    )
)
def test_scan_masks_matches_a_reference(case: tuple[int, list[int], int, bool]) -> None:
    n_ids, raw, allowed, gpu_only = case
    stride = 8
    # ``raw`` holds per-tier bitmasks (gpu | cpu << 8 | storage << 16); the scan takes
    # holder masks.
    tiers = [v & 0xFF if gpu_only else v for v in raw]
    values = [holder_mask(v & 0xFF, v >> 8 & 0xFF, v >> 16, stride) for v in tiers]
    ids = [ReplicaId(f"r{b}") for b in range(n_ids)]
    got = scan_masks(values, allowed, stride, ids).by_replica
    want = {ids[b]: hit for b, hit in reference(tiers, allowed, stride, n_ids).items()}
    assert got == want
    # Runs need not be maximal (a lazy input gives the same answer as a list).
    assert scan_runs([(1, v) for v in values], allowed, stride, ids).by_replica == want
    assert scan_masks(iter(values), allowed, stride, ids).by_replica == want


def test_scan_masks_reads_nothing_past_the_run_where_the_last_hit_ends() -> None:
    def values(head: tuple[int, ...]) -> Iterator[int]:
        yield from head
        raise AssertionError("read past the run where every hit ended")

    ids = [ReplicaId("r0"), ReplicaId("r1")]
    got = scan_masks(values((3, 3, 1, 0)), 0b11, 8, ids).by_replica
    assert got == {ids[0]: ReplicaHit(3, 0, 0), ids[1]: ReplicaHit(2, 0, 0)}
    assert scan_masks(values((0,)), 0b11, 8, ids).by_replica == {}
    assert scan_masks(values((2,)), 0b01, 8, ids).by_replica == {}
