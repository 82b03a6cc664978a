"""The fleet's copies of blocks (``kvroute.replay.copies``), counted from the simulated
pools' own events and checked against the pools' contents."""

from __future__ import annotations

import random

import pytest

from kvkeys.keys import block_keys
from kvkeys.types import ReplicaId
from kvroute.replay.copies import BlockCopies
from kvroute.replay.loop import ReplayConfig, replay_run
from kvroute.replay.requests import ReplayRequest
from kvroute.replay.summary import bounds_of, copies_of, figures
from replica.sim.block_pool import BlockPool, make_engine_hasher
from replica.sim.pool_events import MEDIUM_CPU, Cleared, Removed, Stored

BLOCK = 4


def _recount(pools: dict[ReplicaId, BlockPool]) -> int:
    """Physical blocks holding a key some other block of the fleet also holds."""
    held: dict[object, int] = {}
    for pool in pools.values():
        for key, blocks in pool.cached.items():
            held[key] = held.get(key, 0) + len(blocks)
    return sum(n - 1 for n in held.values())


def _serve(pool: BlockPool, tokens: list[int], rng: random.Random) -> None:
    """One request on ``pool``, as the scheduler runs it: hit, allocate, store, free.
    Sometimes the hit is not looked up (two running requests computing the same blocks),
    which stores a second copy in the same pool, as vLLM does."""
    keys = list(block_keys(tokens, BLOCK, model="m"))
    hit = pool.longest_hit(keys, len(keys)) if rng.random() < 0.8 else []
    pool.touch(hit)
    need = len(keys) - len(hit)
    if need > pool.num_free:
        pool.free(hit)
        return
    blocks = hit + pool.allocate(need)
    pool.cache_full_blocks(blocks, keys, tokens, len(hit), len(keys),
                           cache_salt=None, lora_name=None)
    pool.free(blocks)


@pytest.mark.parametrize("seed", range(6))
def test_copies_match_the_pools_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    pools = {ReplicaId(f"r{i}"): BlockPool(16, BLOCK, hasher=make_engine_hasher(i))
             for i in range(3)}
    prefixes = [[rng.randrange(1, 50) for _ in range(BLOCK * 3)] for _ in range(4)]
    copies = BlockCopies()
    seen = 0
    for step in range(400):
        replica = rng.choice(list(pools))
        pool = pools[replica]
        if rng.random() < 0.03:
            pool.reset()  # refused while blocks are in use; here none are
        else:
            tail = [rng.randrange(1, 50) for _ in range(rng.randrange(0, BLOCK * 3))]
            _serve(pool, rng.choice(prefixes) + tail, rng)
        copies.apply(replica, pool.take_events(), float(step))
        assert copies.copies == _recount(pools)
        seen = max(seen, copies.copies)
    assert seen > 0  # the shared prefixes did get copied


def test_mean_is_over_time_and_other_tiers_are_not_counted() -> None:
    copies = BlockCopies()
    a, b = ReplicaId("a"), ReplicaId("b")
    key, other = block_keys(list(range(1, 2 * BLOCK + 1)), BLOCK, model="m")
    copies.apply(a, [Stored([1], None, [], BLOCK, keys=[key])], 0.0)
    copies.apply(b, [Stored([2], None, [], BLOCK, keys=[key])], 1.0)  # a copy from t=1
    copies.apply(b, [Stored([3], None, [], BLOCK, medium=MEDIUM_CPU, keys=[key])], 2.0)
    assert copies.copies == 1
    copies.apply(b, [Removed([2])], 3.0)  # gone at t=3: one copy for 2 of 4 seconds
    copies.apply(a, [Stored([4], 1, [], BLOCK, keys=[other])], 4.0)
    assert copies.copies == 0
    assert copies.mean_copies() == pytest.approx(0.5)
    copies.apply(b, [Stored([2], None, [], BLOCK, keys=[key]),
                     Stored([5], 2, [], BLOCK, keys=[other])], 4.0)
    assert copies.copies == 2
    copies.apply(a, [Cleared()], 4.0)
    assert copies.copies == 0


def _conversations() -> list[ReplayRequest]:
    """16 conversations of 4 turns, all starting with the same 8-block prefix, each
    adding 4 blocks of its own per turn, all under way together."""
    prefix = tuple(range(1, 8 * 16 + 1))
    out = []
    for s in range(16):
        own = tuple(1000 + 300 * s + i for i in range(256))
        for t in range(1, 5):
            out.append(ReplayRequest(f"s{s}", t, 0.1 * s if t == 1 else 0.0,
                                     0.0 if t == 1 else 2.0, prefix + own[:64 * t], 8))
    return out


async def test_a_replay_counts_its_copies_and_prices_them_against_pooled_lru() -> None:
    reqs = _conversations()
    cfg = ReplayConfig(num_blocks=32, block_size=16)
    capacity = 4 * 31
    # Session affinity never moves a conversation: its copies are the shared prefix, held
    # by every replica once each has served a conversation.
    run = await replay_run("session", reqs, cfg)
    assert all(s.ok for s in run.served)
    prefix_copies = 3 * 8 / capacity
    bounds = bounds_of(run.served, reqs, cfg)
    c = copies_of(run, reqs, cfg)
    fig = figures("session", run.served, bounds, c)
    assert fig.copies_share == c.share == pytest.approx(run.mean_copies / capacity)
    assert 0.8 * prefix_copies < c.share < 1.1 * prefix_copies
    # A pooled cache with that much less room caches less than the pooled bound.
    assert 0 < c.pooled_lru_less < bounds.shares()["pooled_lru"]
    assert fig.lru_less_copies == c.pooled_lru_less
