"""The oracle bound: how much prefill the fleet's caches could have saved on a trace.

Definitions (all counts in prompt tokens, with vLLM's rules: only full blocks are cached,
a request can hit at most ``(n - 1) // B`` leading blocks, keys chained with the
``cache_salt`` folded into block 0, exactly ``kvkeys.keys``):

* ``oracle``: the same fleet (``replicas`` caches of ``blocks_per_replica`` blocks each,
  LRU eviction like vLLM's free queue), but every request goes to the replica that holds
  the longest prefix of it, with perfect and instant knowledge.  Ties (no hit anywhere,
  or equal hits) go to the replica that has served the fewest requests, so new
  conversations spread out.  Load and queueing are ignored: this is the saving a
  perfectly informed cache-affinity router reaches on these caches, the figure a KV-aware
  policy is measured against.
* ``pooled``: one LRU cache as large as the whole fleet, no duplicates: an upper bound
  for any routing with these pool sizes (a shared prompt is cached once, not per replica).
* ``unbounded``: every token that repeats a prefix seen earlier in the trace (infinite
  cache): what the workload itself allows.

Requests are applied in trace order.  After a request, its prompt blocks and the blocks
its generated tokens fill (``output_tokens``; unique content, as replies are never
resent token for token, see ``bench.runner``) are the most recently used, block 0 last,
as vLLM frees a finished request's blocks to the tail of its free queue in reverse.
Blocks pinned by concurrent running requests are not modelled (the pool is treated as
idle between requests).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvkeys.keys import block_keys


@dataclass(frozen=True, slots=True)
class OracleRequest:
    """What the oracle needs of one request."""

    tokens: Sequence[int]
    output_tokens: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class OracleResult:
    """Prompt tokens of the trace and the tokens each bound serves from cache."""

    prompt_tokens: int
    oracle_saved: int
    pooled_saved: int
    unbounded_saved: int

    @property
    def oracle_share(self) -> float:
        """Share of prompt tokens the oracle serves from cache."""
        return self.oracle_saved / self.prompt_tokens if self.prompt_tokens else 0.0


class _LRU:
    """vLLM's cached-block view: a key set evicted from the least recently used end."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[object, None] = OrderedDict()

    def hit(self, keys: Sequence[object], limit: int) -> int:
        n = 0
        for k in keys[:limit]:
            if k not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[object]) -> None:
        """Make ``keys`` the most recently used, the first key most of all (vLLM frees a
        request's blocks in reverse order, so a chain is evicted from its tail)."""
        d = self.keys
        for k in reversed(keys):
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
        if self.capacity is not None:
            while len(d) > self.capacity:
                d.popitem(last=False)


def oracle_bound(
    requests: Iterable[OracleRequest],
    *,
    block_size: int,
    replicas: int,
    blocks_per_replica: int,
    model: str,
) -> OracleResult:
    """The three bounds of the module docstring for ``requests`` in order."""
    if block_size <= 0 or replicas <= 0 or blocks_per_replica <= 0:
        raise ValueError("block_size, replicas and blocks_per_replica must be > 0")
    fleet = [_LRU(blocks_per_replica) for _ in range(replicas)]
    served = [0] * replicas
    pooled = _LRU(blocks_per_replica * replicas)
    unbounded = _LRU(None)
    unique = itertools.count()
    prompt = saved_o = saved_p = saved_u = 0
    for req in requests:
        n = len(req.tokens)
        if n == 0:
            continue
        keys: list[object] = list(
            block_keys(req.tokens, block_size, model=model, cache_salt=req.cache_salt)
        )
        limit = (n - 1) // block_size
        out_blocks = (n + max(req.output_tokens - 1, 0)) // block_size - n // block_size
        written = keys + [("gen", next(unique)) for _ in range(out_blocks)]
        prompt += n
        hits = [c.hit(keys, limit) for c in fleet]
        best = max(range(replicas), key=lambda i: (hits[i], -served[i], -i))
        saved_o += hits[best] * block_size
        served[best] += 1
        fleet[best].insert(written)
        saved_p += pooled.hit(keys, limit) * block_size
        pooled.insert(written)
        saved_u += unbounded.hit(keys, limit) * block_size
        unbounded.insert(keys)
    return OracleResult(prompt, saved_o, saved_p, saved_u)
