"""Events -> index: request keys from token ids, parents, salts, LoRA, tiers, clears."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from index.event_applier import EventIngestor, salt_and_usable_blocks
from index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_batch_legacy,
)
from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.store import IndexUnavailable, KVIndex
from kvkeys.keys import block_keys
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId

R = ReplicaId("r1")
MODEL = "m"
BS = 4
PROMPT = list(range(100, 140))  # 10 blocks


@pytest.fixture(params=["memory", "redis"])
async def index(
    request: pytest.FixtureRequest, redis_url: str, redis_namespace: str
) -> AsyncIterator[KVIndex]:
    idx: KVIndex = (
        InMemoryIndex()
        if request.param == "memory"
        else RedisIndex.from_url(redis_url, key_prefix=redis_namespace, op_timeout_s=2.0)
    )
    try:
        yield idx
    finally:
        await idx.aclose()


def hashes(start: int, n: int, salt: int = 0) -> list[int | bytes]:
    return [1_000 * (salt + 1) + i for i in range(start, start + n)]


async def feed(ing: EventIngestor, events: list[KVEvent], *, legacy: bool = False) -> None:
    batch = KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)
    payload = encode_batch_legacy(batch) if legacy else encode_batch(batch)
    await ing.apply(decode_batch(payload))


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("parent_cache", [0, 1024])
async def test_salt_and_lora_events_match_prompt_keys(
    index: KVIndex, legacy: bool, parent_cache: int
) -> None:
    ing = EventIngestor(index, R, MODEL, parent_cache=parent_cache)
    h = hashes(0, 10)
    extra: list[tuple[Any, ...] | None] = [("ad", "tenant"), ("ad",), ("ad",), ("ad",), ("ad",)]
    first = BlockStored(h[:5], None, PROMPT[:20], BS, 7, "GPU", "ad", extra_keys=extra)
    # The continuation arrives in a later batch: its parent resolves through the index
    # (or the ingestor's record of what it applied).
    rest = BlockStored(h[5:], h[4], PROMPT[20:], BS, 7, "GPU", "ad", extra_keys=[("ad",)] * 5)
    await feed(ing, [first], legacy=legacy)
    await feed(ing, [rest], legacy=legacy)
    want = block_keys(PROMPT, BS, model=MODEL, cache_salt="tenant", lora_name="ad")
    assert (await index.lookup(want)).by_replica == {R: ReplicaHit(10)}
    for other in (
        block_keys(PROMPT, BS, model=MODEL, lora_name="ad"),
        block_keys(PROMPT, BS, model=MODEL, cache_salt="tenant"),
        block_keys(PROMPT, BS, model="other", cache_salt="tenant", lora_name="ad"),
    ):
        assert await index.lookup(other) == PrefixHits()
    assert ing.last_block_size == BS


async def test_plain_events_and_parent_in_same_batch(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL)
    h = hashes(0, 10)
    await feed(ing, [
        BlockStored(h[:3], None, PROMPT[:12], BS, None, None, None),
        BlockStored(h[3:], h[2], PROMPT[12:], BS, None, None, None),
    ])  # fmt: skip
    keys = block_keys(PROMPT, BS, model=MODEL)
    assert (await index.lookup(keys)).by_replica == {R: ReplicaHit(10)}
    assert await index.request_key(R, h[9]) == keys[9]  # type: ignore[arg-type]


async def test_unknown_parent_is_dropped_then_resync_requested(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL, resync_after=3)
    results = []
    for i in range(3):
        batch = KVEventBatch(1.0, [BlockStored([50 + i], 999 + i, PROMPT[:4], BS, None, "GPU",
                                               None)])  # fmt: skip
        results.append(await ing.apply(decode_batch(encode_batch(batch))))
    assert [r.dropped["unknown_parent"] for r in results] == [1, 1, 1]
    assert [r.resync_requested for r in results] == [False, False, True]
    assert await index.replicas() == set()
    # A chain from the root resets the streak.
    ok = await ing.apply(decode_batch(encode_batch(KVEventBatch(1.0, [
        BlockStored([1], None, PROMPT[:4], BS, None, "GPU", None)]))))  # fmt: skip
    assert ok.applied["BlockStored"] == 1 and not ok.resync_requested


async def test_offload_placeholders_and_tiered_removal(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL)
    h = hashes(0, 10)
    keys = block_keys(PROMPT, BS, model=MODEL)
    await feed(ing, [BlockStored(h, None, PROMPT, BS, None, "GPU", None)])
    await feed(ing, [
        BlockStored(h[:6], None, [], 0, None, "CPU", None, group_idx=0),  # token-less
        BlockStored([424242], None, [], 0, None, "CPU", None),  # unknown: ignored
        BlockRemoved(h, "GPU", group_idx=0),
    ])  # fmt: skip
    assert (await index.lookup(keys)).by_replica == {R: ReplicaHit(0, 6)}
    await feed(ing, [BlockRemoved(h[3:4], "cpu")])
    assert (await index.lookup(keys)).by_replica == {R: ReplicaHit(0, 3)}


async def test_duplicate_store_survives_one_removal(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL)
    h = hashes(0, 2)
    ev = BlockStored(h, None, PROMPT[:8], BS, None, "GPU", None)
    await feed(ing, [ev, ev])
    await feed(ing, [BlockRemoved(h, "GPU")])
    assert (await index.lookup(block_keys(PROMPT[:8], BS, model=MODEL))).blocks(R) == 2


async def test_all_blocks_cleared_in_batch_order(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL)
    h = hashes(0, 10)
    keys = block_keys(PROMPT, BS, model=MODEL)
    await feed(ing, [
        BlockStored(h[:5], None, PROMPT[:20], BS, None, "GPU", None),
        AllBlocksCleared(),
        # The parent was cleared in this very batch: not resolvable any more.
        BlockStored(h[5:], h[4], PROMPT[20:], BS, None, "GPU", None),
        BlockStored(hashes(0, 2, salt=1), None, PROMPT[:8], BS, None, "GPU", None),
    ])  # fmt: skip
    assert (await index.lookup(keys)).by_replica == {R: ReplicaHit(2)}


async def test_other_groups_malformed_and_multimodal(index: KVIndex) -> None:
    ing = EventIngestor(index, R, MODEL)
    h = hashes(0, 3)
    batch = KVEventBatch(1.0, [
        BlockStored(h, None, PROMPT[:12], BS, None, "GPU", None, group_idx=1,
                    kv_cache_spec_kind="full_attention"),
        BlockStored(h, None, PROMPT[:12], BS, None, "GPU", None, group_idx=0,
                    kv_cache_spec_kind="sliding_window"),
        BlockStored(h, None, PROMPT[:11], BS, None, "GPU", None),  # token count mismatch
        BlockRemoved(h, "GPU", group_idx=1),
    ])  # fmt: skip
    result = await ing.apply(decode_batch(encode_batch(batch)))
    assert result.dropped == {"other_group": 3, "malformed": 1}
    assert await index.replicas() == set()
    # Block 1 carries a multimodal key: only block 0 can be keyed from tokens.
    await feed(ing, [BlockStored(h, None, PROMPT[:12], BS, None, "GPU", None,
                                 extra_keys=[None, ("img-hash", 0), None])])  # fmt: skip
    keys = block_keys(PROMPT[:12], BS, model=MODEL)
    assert (await index.lookup(keys)).by_replica == {R: ReplicaHit(1)}


def test_salt_and_usable_blocks() -> None:
    assert salt_and_usable_blocks(None, 3, None) == (None, 3)
    assert salt_and_usable_blocks([["s"], None], 2, None) == ("s", 2)
    assert salt_and_usable_blocks([["ad", "s"], ["ad"]], 2, "ad") == ("s", 2)
    assert salt_and_usable_blocks([["ad"], ["ad"]], 2, "ad") == (None, 2)
    assert salt_and_usable_blocks([[["mm", 0]]], 2, None) == (None, 0)
    assert salt_and_usable_blocks([["s", b"digest"]], 1, None) == ("s", 0)
    assert salt_and_usable_blocks([None, ["late-string"]], 2, None) == (None, 1)


class CountingIndex(InMemoryIndex):
    """An in-memory index that counts parent lookups and can refuse writes."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[int]] = []
        self.refuse = False

    async def request_keys(self, replica: ReplicaId, engine_keys: Any) -> Any:
        self.asked.append(list(engine_keys))
        return await super().request_keys(replica, engine_keys)

    async def apply(self, replica: ReplicaId, ops: Any) -> None:
        if self.refuse:
            raise IndexUnavailable("refused")
        await super().apply(replica, ops)


async def test_parents_resolve_from_what_the_ingestor_applied() -> None:
    idx = CountingIndex()
    ing = EventIngestor(idx, R, MODEL, parent_cache=1024)
    h = hashes(0, 10)
    await feed(ing, [BlockStored(h[:5], None, PROMPT[:20], BS, None, "GPU", None)])
    await feed(ing, [BlockStored(h[5:8], h[4], PROMPT[20:32], BS, None, "GPU", None)])
    assert idx.asked == []  # the parent was stored by an earlier batch: no lookup
    want = block_keys(PROMPT, BS, model=MODEL)
    assert (await idx.lookup(want)).by_replica == {R: ReplicaHit(8)}
    # A removal (of any tier) forgets the key: the index is asked, and says unknown.
    await feed(ing, [BlockRemoved(h[7:8], "GPU")])
    result_rest = await ing.apply(decode_batch(encode_batch(KVEventBatch(
        1.0, [BlockStored(h[8:], h[7], PROMPT[32:], BS, None, "GPU", None)], 0))))  # fmt: skip
    assert idx.asked == [[h[7]]] and result_rest.dropped["unknown_parent"] == 1
    # A clear forgets everything, and so does reset().
    await feed(ing, [AllBlocksCleared()])
    await feed(ing, [BlockStored(h[5:6], h[4], PROMPT[20:24], BS, None, "GPU", None)])
    assert idx.asked[-1] == [h[4]]
    await feed(ing, [BlockStored(h[:5], None, PROMPT[:20], BS, None, "GPU", None)])
    ing.reset()
    await feed(ing, [BlockStored(h[5:6], h[4], PROMPT[20:24], BS, None, "GPU", None)])
    assert idx.asked[-1] == [h[4]] and len(idx.asked) == 3


async def test_parent_cache_is_bounded_and_follows_successful_writes() -> None:
    idx = CountingIndex()
    ing = EventIngestor(idx, R, MODEL, parent_cache=3)
    h = hashes(0, 10)
    await feed(ing, [BlockStored(h[:5], None, PROMPT[:20], BS, None, "GPU", None)])
    # Only the 3 most recent engine keys are kept: h[1]'s child asks the index.
    await feed(ing, [BlockStored(h[5:6], h[4], PROMPT[20:24], BS, None, "GPU", None)])
    assert idx.asked == []
    await feed(ing, [BlockStored(hashes(0, 1, salt=5), h[1], PROMPT[8:12], BS, None, "GPU",
                                 None)])  # fmt: skip
    assert idx.asked == [[h[1]]]
    # A batch the index refused is not remembered.
    idx.refuse = True
    with pytest.raises(IndexUnavailable):
        await feed(ing, [BlockStored(h[6:7], h[5], PROMPT[24:28], BS, None, "GPU", None)])
    idx.refuse = False
    await feed(ing, [BlockStored(h[7:8], h[6], PROMPT[28:32], BS, None, "GPU", None)])
    assert idx.asked[-1] == [h[6]]
