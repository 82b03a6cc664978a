"""Unit tests of the simulated block pool against vLLM V1's semantics."""

from __future__ import annotations

import pytest

from kvkeys.keys import block_keys
from kvkeys.types import RequestKey
from replica.sim.block_pool import (
    Block,
    BlockPool,
    Cleared,
    Removed,
    Stored,
    make_engine_hasher,
)
from replica.sim.offload import HostTier

BS = 4


def _pool(num_blocks: int = 9, seed: int = 1, host: HostTier | None = None) -> BlockPool:
    return BlockPool(num_blocks, BS, hasher=make_engine_hasher(seed), host_tier=host)


def _keys(tokens: list[int], salt: str | None = None, lora: str | None = None) -> list[RequestKey]:
    return block_keys(tokens, BS, model="m", cache_salt=salt, lora_name=lora)


def _run(pool: BlockPool, tokens: list[int], salt: str | None = None,
         lora: str | None = None) -> tuple[list[Block], int]:
    """Admit a prompt like the scheduler does: hit, touch, allocate, cache, then free."""
    keys = _keys(tokens, salt, lora)
    hit = pool.longest_hit(keys, (len(tokens) - 1) // BS)
    pool.touch(hit)
    need = -(-len(tokens) // BS) - len(hit)
    blocks = hit + pool.allocate(need)
    pool.cache_full_blocks(blocks, keys, tokens, len(hit), len(tokens) // BS,
                           cache_salt=salt, lora_name=lora)
    return blocks, len(hit) * BS


def test_null_block_is_reserved_and_usage_counts_cached_free_blocks_as_free() -> None:
    pool = _pool(9)
    assert pool.num_free == 8
    blocks, _ = _run(pool, list(range(10)))  # 3 blocks: 2 full + 1 partial
    assert pool.num_free == 5
    assert pool.usage() == pytest.approx(3 / 8)
    pool.free(blocks)
    assert pool.num_free == 8 and pool.usage() == 0.0  # cached but evictable = free
    assert all(b.block_id != 0 for b in blocks)


def test_last_prompt_token_is_always_recomputed() -> None:
    pool = _pool()
    tokens = list(range(8))  # exactly two full blocks
    blocks, cached = _run(pool, tokens)
    pool.free(blocks)
    _, cached = _run(pool, tokens)
    assert cached == 4  # (8 - 1) // 4 = 1 block, not 2
    _, cached = _run(pool, tokens + [99])
    assert cached == 8


def test_stored_events_chain_parents_and_prefix_hits_store_nothing() -> None:
    pool = _pool(20)
    blocks, _ = _run(pool, list(range(9)))
    ev = pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], Stored)
    first = ev[0]
    assert first.parent_block_hash is None and first.token_ids == list(range(8))
    assert first.block_size == BS and first.extra_keys == [None, None]
    pool.free(blocks)
    _, cached = _run(pool, list(range(12)) + [50])
    assert cached == 8
    (second,) = pool.take_events()
    assert isinstance(second, Stored)
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == [8, 9, 10, 11]


def test_engine_hashes_differ_from_request_keys_and_between_processes() -> None:
    a, b = _pool(seed=1), _pool(seed=2)
    _run(a, list(range(8)))
    _run(b, list(range(8)))
    (sa,), (sb,) = a.take_events(), b.take_events()
    assert isinstance(sa, Stored) and isinstance(sb, Stored)
    assert sa.keys == sb.keys == _keys(list(range(8)))
    assert set(sa.block_hashes).isdisjoint(sa.keys)
    assert sa.block_hashes != sb.block_hashes


def test_tail_blocks_are_evicted_first_then_least_recently_used() -> None:
    pool = _pool(7)  # 6 usable blocks
    a, _ = _run(pool, list(range(12)))  # 3 full blocks
    b, _ = _run(pool, list(range(100, 112)))
    pool.free(a)
    pool.free(b)
    pool.take_events()
    a_hashes = [blk.engine_hash for blk in a]
    # Evict two blocks: A's tail first (free order is reversed), then A's middle.
    pool.allocate(2)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, Removed)]
    assert removed == [a_hashes[2], a_hashes[1]]
    # A's head still hits; the chain breaks after it.
    assert len(pool.longest_hit(_keys(list(range(12)) + [7]), 3)) == 1


def test_touch_takes_a_hit_out_of_the_free_queue() -> None:
    pool = _pool(5)  # 4 usable
    a, _ = _run(pool, list(range(9)))  # 2 full + 1 partial
    pool.free(a)
    blocks, cached = _run(pool, list(range(8)) + [42, 43])
    assert cached == 8
    assert all(blk.block_id not in pool.free_queue for blk in blocks)
    assert pool.num_free == 1


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    pool = _pool(6)
    a, _ = _run(pool, list(range(6)))  # 1 full + 1 partial (unhashed)
    pool.free(a)
    partial = a[1]
    assert partial.key is None
    assert next(iter(pool.free_queue.values())) is partial


def test_salt_and_lora_isolate_and_are_published() -> None:
    pool = _pool(20)
    tokens = list(range(9))
    b1, _ = _run(pool, tokens, salt="s1")
    pool.free(b1)
    _, cached_other_salt = _run(pool, tokens, salt="s2")
    _, cached_no_salt = _run(pool, tokens)
    b4, cached_same = _run(pool, tokens, salt="s1")
    assert (cached_other_salt, cached_no_salt, cached_same) == (0, 0, 8)
    stored = [e for e in pool.take_events() if isinstance(e, Stored)]
    assert stored[0].extra_keys == [["s1"], None]
    _run(pool, tokens, lora="ad")
    (lora_ev,) = [e for e in pool.take_events() if isinstance(e, Stored)]
    assert lora_ev.lora_name == "ad" and lora_ev.extra_keys == [["ad"], ["ad"]]


def test_duplicate_content_is_stored_and_removed_per_copy() -> None:
    pool = _pool(9)
    tokens = list(range(8))
    keys = _keys(tokens)
    # Two requests computing the same prompt at once (neither hit the other).
    x = pool.allocate(2)
    y = pool.allocate(2)
    pool.cache_full_blocks(x, keys, tokens, 0, 2, cache_salt=None, lora_name=None)
    pool.cache_full_blocks(y, keys, tokens, 0, 2, cache_salt=None, lora_name=None)
    assert len(pool.cached[keys[0]]) == 2
    assert pool.get_cached(keys[0]) is x[0]  # the first copy serves hits
    pool.free(x)
    pool.free(y)
    pool.take_events()
    pool.allocate(8)
    removed = [e for e in pool.take_events() if isinstance(e, Removed)]
    assert len(removed) == 4 and not pool.cached


def test_reset_refused_while_in_use_then_clears() -> None:
    pool = _pool()
    blocks, _ = _run(pool, list(range(8)))
    assert not pool.reset()
    pool.free(blocks)
    pool.take_events()
    assert pool.reset()
    assert pool.take_events() == [Cleared()]
    assert not pool.cached
    _, cached = _run(pool, list(range(9)))
    assert cached == 0


def test_host_tier_receives_evictions_in_order_and_is_bounded() -> None:
    host = HostTier(2, block_bytes=1000, bandwidth_bytes_per_s=1e6)
    pool = _pool(4, host=host)  # 3 usable
    a, _ = _run(pool, list(range(12)))  # 3 full blocks
    pool.free(a)
    pool.take_events()
    pool.allocate(3)
    kinds = [(type(e).__name__, e.medium) for e in pool.take_events()
             if isinstance(e, Stored | Removed)]
    # Each eviction: CPU store first, then the GPU removal; the third overflows the tier.
    assert kinds == [
        ("Stored", "CPU"), ("Removed", "GPU"),
        ("Stored", "CPU"), ("Removed", "GPU"),
        ("Stored", "CPU"), ("Removed", "CPU"), ("Removed", "GPU"),
    ]
    assert len(host) == 2
    keys = _keys(list(range(12)))
    # Tail-first eviction sent block 2 to the tier first, so it is the one that overflowed.
    assert host.longest_hit(keys) == 2
    assert host.longest_hit(keys[2:]) == 0
    assert host.load_seconds(2) == pytest.approx(0.002)


def test_allocate_more_than_free_raises() -> None:
    pool = _pool(3)
    with pytest.raises(ValueError):
        pool.allocate(3)
