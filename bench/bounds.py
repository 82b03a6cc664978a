"""Bounds on the prompt tokens any routing of a trace can serve from cache.

Every figure uses vLLM's rules: only full blocks are cached, a request hits at most
``(n - 1) // B`` leading blocks (the last prompt token is always recomputed), and a
block is a hit only if every block before it is one too (keys are chained, so a block
is only found through its predecessors).  Requests are taken in trace order.

* ``pooled_lru``: one LRU cache as large as the whole fleet (``capacity`` blocks, no
  copies): a request's prompt blocks and the blocks its reply fills become the most
  recently used, its first block most of all (vLLM frees a finished request's blocks to
  the tail of its free queue in reverse, so a chain is evicted from its tail).  What a
  fleet could reach if its caches were one; not a bound (LRU is not optimal).
* ``pooled_optimal``: the same capacity with optimal replacement, knowing the future
  (Belady): when a block must go, the one whose next use is farthest goes, and a block
  whose next use is farther than every cached block's is not cached at all.  A block's
  next use is never before its predecessor's (every prompt that contains it contains
  its predecessor), and ties evict the later block of a chain first, so the cache is
  always prefix-closed and the per-block optimum obeys the prefix rule.  Every full
  prompt block is an access (a block past the last-token cap is stored, so a longer
  prompt can hit it later) but counts as a hit only below the cap; reply blocks never
  repeat and are left out (as if bypassed).  An upper
  bound for any routing on a fleet of that total capacity: the fleet's caches together
  are one cache of that size, and no placement or replacement can beat the optimum.
* ``unbounded``: an infinite cache: every block that repeats a prefix seen earlier in
  the trace.  What the workload itself allows.

``share(saved)`` reports a policy's cached tokens as a share of each bound;
``pooled_lru_saved`` gives the pooled LRU figure alone at any capacity (the replay
compares a fleet with one such cache less the copies its pools held).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvkeys.keys import block_keys

__all__ = ["Bounds", "CacheRequest", "cache_bounds", "optimal_hits", "pooled_lru_saved"]

_NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What the bounds need of one request."""

    tokens: Sequence[int]
    output_tokens: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Bounds:
    """Prompt tokens of the trace and the tokens each bound serves from cache."""

    prompt_tokens: int
    pooled_lru_saved: int
    pooled_optimal_saved: int
    unbounded_saved: int

    def share(self, saved: int) -> dict[str, float | None]:
        """``saved`` cached tokens as a share of each bound (``None`` where it is 0)."""
        return {
            "of_pooled_lru": saved / self.pooled_lru_saved if self.pooled_lru_saved else None,
            "of_optimal": (saved / self.pooled_optimal_saved
                           if self.pooled_optimal_saved else None),
            "of_unbounded": saved / self.unbounded_saved if self.unbounded_saved else None,
        }

    def shares(self) -> dict[str, float]:
        """Each bound as a share of the trace's prompt tokens."""
        n = self.prompt_tokens or 1
        return {"pooled_lru": self.pooled_lru_saved / n,
                "pooled_optimal": self.pooled_optimal_saved / n,
                "unbounded": self.unbounded_saved / n}


def _lru_hits(
    chains: Sequence[tuple[list[object], int, int]], capacity: int | None
) -> list[int]:
    """Hit blocks per request for an LRU cache of ``capacity`` blocks (``None``:
    unbounded; reply blocks are then not stored, they never repeat)."""
    cache: OrderedDict[object, None] = OrderedDict()
    unique = itertools.count()
    out: list[int] = []
    for keys, limit, out_blocks in chains:
        n = 0
        for k in keys[:limit]:
            if k not in cache:
                break
            n += 1
        out.append(n)
        written: list[object] = list(keys)
        if capacity is not None:
            written += [("reply", next(unique)) for _ in range(out_blocks)]
        for k in reversed(written):
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
        if capacity is not None:
            while len(cache) > capacity:
                cache.popitem(last=False)
    return out


def optimal_hits(
    accesses: Sequence[Sequence[object]], limits: Sequence[int], capacity: int
) -> list[int]:
    """Belady with bypass over requests that each access a chain of block keys: per
    request, the leading keys found among its first ``limits[i]`` (see the module
    docstring).  ``accesses[i]`` are the keys request ``i`` stores, in chain order."""
    # Next use of every access, scanning backwards.
    flat = [(i, j, k) for i, keys in enumerate(accesses) for j, k in enumerate(keys)]
    nxt = [_NEVER] * len(flat)
    seen: dict[object, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        k = flat[pos][2]
        nxt[pos] = seen.get(k, _NEVER)
        seen[k] = pos
    cached: dict[object, tuple[int, int]] = {}  # key -> (next use, chain position)
    heap: list[tuple[int, int, int, object]] = []  # (-next use, -chain pos, tie, key)
    tie = itertools.count()
    hits = [0] * len(accesses)
    broken = [False] * len(accesses)
    for pos, (i, j, k) in enumerate(flat):
        if k in cached and not broken[i] and j < limits[i]:
            hits[i] += 1
        else:
            broken[i] = True
        cached.pop(k, None)
        use = nxt[pos]
        if use == _NEVER or capacity <= 0:
            continue
        # Make room: evict the farthest next use (latest in its chain on ties), unless
        # this block is used even later (bypass).
        while len(cached) >= capacity:
            neg_use, neg_j, _, victim = heap[0]
            entry = cached.get(victim)
            if entry is None or entry != (-neg_use, -neg_j):
                heapq.heappop(heap)  # stale
                continue
            if (-neg_use, -neg_j) < (use, j):
                break
            heapq.heappop(heap)
            del cached[victim]
        if len(cached) >= capacity:
            continue
        cached[k] = (use, j)
        heapq.heappush(heap, (-use, -j, next(tie), k))
    return hits


def _chains(
    requests: Iterable[CacheRequest], block_size: int, model: str
) -> tuple[list[tuple[list[object], int, int]], int]:
    """Per request with a prompt: its block keys, how many may hit, the blocks its reply
    fills; and the prompt tokens of them all."""
    chains: list[tuple[list[object], int, int]] = []
    prompt = 0
    for req in requests:
        n = len(req.tokens)
        if n == 0:
            continue
        keys: list[object] = list(
            block_keys(req.tokens, block_size, model=model, cache_salt=req.cache_salt))
        limit = (n - 1) // block_size
        out_blocks = (n + max(req.output_tokens - 1, 0)) // block_size - n // block_size
        chains.append((keys, limit, out_blocks))
        prompt += n
    return chains, prompt


def pooled_lru_saved(
    requests: Iterable[CacheRequest], *, block_size: int, capacity: int, model: str
) -> int:
    """The tokens one LRU cache of ``capacity`` blocks serves from cache (the pooled LRU
    figure of ``cache_bounds``, alone, at any capacity)."""
    if block_size <= 0 or capacity <= 0:
        raise ValueError("block_size and capacity must be > 0")
    chains, _ = _chains(requests, block_size, model)
    return sum(_lru_hits(chains, capacity)) * block_size


def cache_bounds(
    requests: Iterable[CacheRequest], *, block_size: int, capacity: int, model: str
) -> Bounds:
    """The three figures of the module docstring for ``requests`` in order, with
    ``capacity`` blocks in the pooled caches (the fleet's usable blocks together)."""
    if block_size <= 0 or capacity <= 0:
        raise ValueError("block_size and capacity must be > 0")
    chains, prompt = _chains(requests, block_size, model)
    lru = _lru_hits(chains, capacity)
    unbounded = _lru_hits(chains, None)
    optimal = optimal_hits([keys for keys, _, _ in chains], [lim for _, lim, _ in chains],
                           capacity)
    return Bounds(
        prompt_tokens=prompt,
        pooled_lru_saved=sum(lru) * block_size,
        pooled_optimal_saved=sum(optimal) * block_size,
        unbounded_saved=sum(unbounded) * block_size,
    )
