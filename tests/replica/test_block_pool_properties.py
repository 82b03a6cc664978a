"""Property tests of the block pool: random admissions, frees and evictions.

Invariants checked after every step:
* reference counts never go negative;
* a block is in the free queue iff nobody references it (never both free and in use);
* the event log is consistent: GPU ``Stored`` minus ``Removed`` (as a multiset of engine
  hashes) equals the hashes of the blocks currently cached;
* the hashed part of the free queue is in LRU order (the order the blocks were released).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvkeys.keys import block_keys
from replica.sim.block_pool import Block, BlockPool, Cleared, Removed, Stored, make_engine_hasher

BS = 2
PREFIXES = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10]]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(10, BS, hasher=make_engine_hasher(3))
        self.live: list[list[Block]] = []
        self.ledger: Counter[int] = Counter()
        self.release_order: list[int] = []  # block ids, as they entered the queue's tail

    def _apply_events(self) -> None:
        for ev in self.pool.take_events():
            if isinstance(ev, Stored):
                self.ledger.update(ev.block_hashes)
            elif isinstance(ev, Removed):
                self.ledger.subtract(ev.block_hashes)
            else:
                assert isinstance(ev, Cleared)
                self.ledger.clear()

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=5),
          salt=st.sampled_from([None, "s"]))
    def admit(self, prefix: list[int], tail: list[int], salt: str | None) -> None:
        tokens = prefix + tail
        keys = block_keys(tokens, BS, model="m", cache_salt=salt)
        hit = self.pool.longest_hit(keys, (len(tokens) - 1) // BS)
        need = -(-len(tokens) // BS) - len(hit) + self.pool.num_evictable(hit)
        if need > self.pool.num_free:
            return
        self.pool.touch(hit)
        blocks = hit + self.pool.allocate(-(-len(tokens) // BS) - len(hit))
        self.pool.cache_full_blocks(blocks, keys, tokens, len(hit), len(tokens) // BS,
                                    cache_salt=salt, lora_name=None)
        self.live.append(blocks)
        self._apply_events()

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        blocks = self.live.pop(index % len(self.live))
        before = set(self.pool.free_queue)
        self.pool.free(blocks)
        for b in reversed(blocks):
            if b.block_id not in before and b.block_id in self.pool.free_queue and b.key:
                self.release_order.append(b.block_id)

    @rule()
    def reset(self) -> None:
        if self.pool.reset():
            self._apply_events()

    @invariant()
    def ref_counts_non_negative(self) -> None:
        assert all(b.ref_cnt >= 0 for b in self.pool.blocks)

    @invariant()
    def free_iff_unreferenced(self) -> None:
        for b in self.pool.blocks[1:]:
            assert (b.block_id in self.pool.free_queue) == (b.ref_cnt == 0)
        in_use = {b.block_id for blocks in self.live for b in blocks}
        assert in_use.isdisjoint(self.pool.free_queue)

    @invariant()
    def events_match_cache(self) -> None:
        cached = Counter(
            b.engine_hash for copies in self.pool.cached.values() for b in copies.values()
        )
        assert +self.ledger == cached

    @invariant()
    def hashed_free_queue_in_release_order(self) -> None:
        queue = [bid for bid, b in self.pool.free_queue.items() if b.key is not None]
        order = {bid: i for i, bid in enumerate(self.release_order)}
        # Each block's last release decides its position.
        last: dict[int, int] = {}
        for i, bid in enumerate(self.release_order):
            last[bid] = i
        positions = [last.get(bid, -1) for bid in queue]
        assert positions == sorted(positions), (queue, order)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
