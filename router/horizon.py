"""The eviction horizon of each replica: how long an idle cached block survives.

vLLM keeps freed blocks in an LRU free queue and allocates from its head, so a block
freed now (a finished turn's KV) is evicted once every block ahead of it has been
allocated.  Ahead of it are all currently free blocks (never-used ones and older cached
ones alike: ``kv_cache_usage_perc`` counts evictable cached blocks as free).  Hence::

    horizon_s = free_blocks / allocation_rate_blocks_per_s

* ``free_blocks = num_gpu_blocks * (1 - kv_cache_usage_perc)`` from the scrape, carried
  forward between scrapes by what the router sees happen to the pool: blocks newly
  allocated (``observe_allocated``, from the KV events) leave it, the blocks of a finished
  request (``observe_released``) return to it.  A scrape is a snapshot of a pool that
  changes by whole conversations in milliseconds: when a session's turn finishes, the
  blocks ahead of its own in the LRU queue include everything other turns freed since
  the last scrape, which the snapshot alone misses (an eviction predicted that never
  comes).  Cached blocks a request takes back from the free queue are not subtracted:
  the router cannot tell them from blocks a concurrent request already holds (a burst
  sharing a prompt would count the prompt once per request), and a release of blocks
  still shared is likewise counted in full, so between scrapes the estimate errs high,
  never low.  Traffic the router does not see (another router's) is corrected at the
  next scrape.
* ``allocation_rate``: newly computed blocks per second, an exponentially weighted mean
  over ``tau_s`` of counter deltas: prompt tokens computed (prompt tokens minus prefix
  cache hits, or ``prompt_tokens_by_source{source="local_compute"}`` when exported) plus
  generated tokens, over the block size.  KV events can feed the same estimator
  (``observe_allocated``: ``BlockStored`` blocks) where the scrape lacks the counters.

A horizon is ``None`` (unknown) without a fresh pool observation, and ``inf`` when
nothing is being allocated (no churn, nothing gets evicted).  The scoring treats both as
"no eviction risk"; the metric exports the finite values.

The other half of the comparison is how long users take between turns (the think-time
histogram lives in ``RouterMetrics``, fed from ``router.session_table``); this
module only classifies a return as within or beyond the horizon of the replica holding
the session.  Times are passed in: no clock here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvkeys.types import ReplicaId

__all__ = ["HorizonEstimator", "PoolSample", "ReturnOutcome", "classify_return"]

ReturnOutcome = Literal["within_horizon", "beyond_horizon", "unknown"]


@dataclass(frozen=True, slots=True)
class PoolSample:
    """What one scrape of a replica tells about its KV pool and its churn."""

    t: float
    block_size: int | None
    num_gpu_blocks: int | None
    kv_usage: float | None
    """``vllm:kv_cache_usage_perc`` in [0, 1]."""
    computed_prompt_tokens_total: float | None
    """Cumulative prompt tokens computed (not served from cache)."""
    generation_tokens_total: float | None


class _Replica:
    __slots__ = (
        "rate", "pending_blocks", "last_rate_t", "free_blocks", "pool_t",
        "last_prompt", "last_gen", "block_size", "allocated", "num_blocks",
        "released", "marks",
    )

    def __init__(self) -> None:
        self.rate: float | None = None
        self.pending_blocks = 0.0
        self.last_rate_t: float | None = None
        self.free_blocks: float | None = None
        self.pool_t: float | None = None
        self.last_prompt: float | None = None
        self.last_gen: float | None = None
        self.block_size: int | None = None
        self.allocated = 0.0
        self.num_blocks: float | None = None
        self.released = 0.0
        self.marks = (0.0, 0.0)
        """``(allocated, released)`` at the last pool observation."""

    def free_now(self) -> float | None:
        """The scraped free pool, carried forward by what happened since."""
        if self.free_blocks is None:
            return None
        alloc0, released0 = self.marks
        free = self.free_blocks + (self.released - released0) - (self.allocated - alloc0)
        upper = self.num_blocks if self.num_blocks is not None else free
        return min(upper, max(0.0, free))


class HorizonEstimator:
    """Per-replica allocation rate and free pool, hence the eviction horizon."""

    def __init__(self, *, tau_s: float = 30.0, stale_s: float = 10.0, min_dt_s: float = 0.5):
        self.tau_s = tau_s
        self.stale_s = stale_s
        self.min_dt_s = min_dt_s
        self._r: dict[ReplicaId, _Replica] = {}

    def _get(self, replica: ReplicaId) -> _Replica:
        state = self._r.get(replica)
        if state is None:
            state = self._r[replica] = _Replica()
        return state

    def observe_scrape(
        self, replica: ReplicaId, s: PoolSample, *, count_allocations: bool = True
    ) -> None:
        """Fold one scrape in: pool size and counter deltas (counter resets are skipped).

        ``count_allocations=False`` when KV events already feed ``observe_allocated`` for
        this replica (they are exact and immediate; counting both would double)."""
        st = self._get(replica)
        if s.block_size:
            st.block_size = s.block_size
        pool = False
        if s.num_gpu_blocks is not None and s.kv_usage is not None:
            pool = True
            st.num_blocks = float(s.num_gpu_blocks)
            st.free_blocks = st.num_blocks * (1.0 - min(1.0, max(0.0, s.kv_usage)))
            st.pool_t = s.t
        tokens = 0.0
        if s.computed_prompt_tokens_total is not None:
            if st.last_prompt is not None and s.computed_prompt_tokens_total >= st.last_prompt:
                tokens += s.computed_prompt_tokens_total - st.last_prompt
            st.last_prompt = s.computed_prompt_tokens_total
        if s.generation_tokens_total is not None:
            if st.last_gen is not None and s.generation_tokens_total >= st.last_gen:
                tokens += s.generation_tokens_total - st.last_gen
            st.last_gen = s.generation_tokens_total
        if st.block_size and count_allocations:
            self.observe_allocated(replica, s.t, tokens / st.block_size)
        if pool:  # the counters above are already in the snapshot
            st.marks = (st.allocated, st.released)

    def observe_allocated(self, replica: ReplicaId, t: float, blocks: float) -> None:
        """``blocks`` newly allocated at time ``t`` (from counters or ``BlockStored``)."""
        st = self._get(replica)
        st.pending_blocks += max(0.0, blocks)
        st.allocated += max(0.0, blocks)
        if st.last_rate_t is None:
            st.last_rate_t = t
            st.pending_blocks = 0.0
            return
        dt = t - st.last_rate_t
        if dt < self.min_dt_s:
            return
        sample = st.pending_blocks / dt
        if st.rate is None:
            st.rate = sample
        else:
            st.rate += (1.0 - math.exp(-dt / self.tau_s)) * (sample - st.rate)
        st.pending_blocks = 0.0
        st.last_rate_t = t

    def observe_released(self, replica: ReplicaId, blocks: float) -> None:
        """A request on ``replica`` finished: its ``blocks`` (prompt and output) return
        to the free queue."""
        self._get(replica).released += max(0.0, blocks)

    def allocated(self, replica: ReplicaId) -> float:
        """Blocks allocated on ``replica`` since it was first seen (a running count: the
        difference between two readings is what LRU consumed in between)."""
        st = self._r.get(replica)
        return st.allocated if st is not None else 0.0

    def free_blocks(self, replica: ReplicaId, now: float) -> float | None:
        """Free (incl. evictable) blocks now: the last fresh scrape carried forward (see
        the module docstring), if any."""
        st = self._r.get(replica)
        if st is None or st.pool_t is None or now - st.pool_t > self.stale_s:
            return None
        return st.free_now()

    def pool_blocks(self, replica: ReplicaId) -> float | None:
        """The replica's KV pool in blocks, from its last scrape, if any."""
        st = self._r.get(replica)
        return st.num_blocks if st is not None else None

    def allocation_rate(self, replica: ReplicaId) -> float | None:
        """Blocks allocated per second (EWMA), if measured."""
        st = self._r.get(replica)
        return st.rate if st is not None else None

    def horizon_s(self, replica: ReplicaId, now: float) -> float | None:
        """Seconds an idle block freed now survives: ``None`` unknown, ``inf`` no churn."""
        st = self._r.get(replica)
        if st is None or st.free_blocks is None or st.pool_t is None:
            return None
        if now - st.pool_t > self.stale_s or st.rate is None:
            return None
        if st.rate <= 1e-9:
            return math.inf
        return st.free_blocks / st.rate

    def forget(self, replica: ReplicaId) -> None:
        """Drop a replica's state (it restarted or left)."""
        self._r.pop(replica, None)


def classify_return(think_s: float, horizon_s: float | None) -> ReturnOutcome:
    """Whether a session came back to its replica before its idle blocks were evicted."""
    if horizon_s is None:
        return "unknown"
    return "within_horizon" if think_s <= horizon_s else "beyond_horizon"
