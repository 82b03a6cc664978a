"""The prefix scan shared by the index backends: tier bitmasks in, ``PrefixHits`` out.

Each block key's presence is one int holding three bitmasks over replica bit positions,
``gpu | cpu << S | storage << 2S`` (``S``, the stride, is the backend's replica capacity).
``scan_masks`` walks the values of a prompt's keys in order, keeps the set of replicas
that held every block so far, and records for each replica the length of its run (keys
are chained, so a replica's hit stops at its first miss) and how many blocks of the run
are held only off-GPU (each block counted in its fastest tier).  Cost: a few int
operations per key when every active replica holds the block on GPU; per-replica work
only where runs end or tiers differ.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from operator import and_, neg

from index.types import PrefixHits, ReplicaHit, ReplicaId

__all__ = ["any_tier", "scan_masks"]


def any_tier(value: int, stride: int) -> int:
    """The replicas that hold a block in any tier."""
    lim = (1 << stride) - 1
    return (value | value >> stride | value >> 2 * stride) & lim


def scan_masks(
    values: Sequence[int], allowed: int, stride: int, ids: Sequence[ReplicaId]
) -> PrefixHits:
    """Per replica, the consecutive leading blocks held among ``allowed`` replicas.

    ``values[i]`` is block ``i``'s tier mask (0 when nobody holds it); ``ids[b]`` names
    the replica at bit ``b`` (bits without a name are ignored)."""
    if not values:
        return PrefixHits()
    s = stride
    lim = (1 << s) - 1
    offloaded = max(values) > lim
    if offloaded:
        anyv = [v if v <= lim else (v | v >> s | v >> 2 * s) & lim for v in values]
    else:
        anyv = list(values)
    runs = _runs(anyv, anyv[0] & allowed)
    if not runs:
        return PrefixHits()
    slow: dict[int, list[int]] = {}  # bit -> [cpu, storage] blocks within its run
    if offloaded:
        for i, v in enumerate(values):
            if v <= lim:
                continue
            off = anyv[i] & ~v
            while off:
                low = off & -off
                b = low.bit_length() - 1
                off ^= low
                if runs.get(b, 0) > i:
                    c = slow.setdefault(b, [0, 0])
                    c[0 if (v >> s) & low else 1] += 1
    out: dict[ReplicaId, ReplicaHit] = {}
    n_ids = len(ids)
    for b, run in runs.items():
        if b >= n_ids:
            continue
        tiers = slow.get(b)
        if tiers is None:
            out[ids[b]] = ReplicaHit(run)
        else:
            out[ids[b]] = ReplicaHit(run - tiers[0] - tiers[1], tiers[0], tiers[1])
    return PrefixHits(out)


def _runs(values: Sequence[int], active: int) -> dict[int, int]:
    """Bit -> length of its leading run, for the bits of ``active`` (runs > 0 only).

    The running AND (computed in C) is non-increasing, each value a submask of the
    previous, so each drop is found by bisection instead of a Python loop per key."""
    runs: dict[int, int] = {}
    if not active:
        return runs
    acc = list(accumulate(values, and_, initial=active))
    # acc[i] = replicas holding blocks 0..i-1; a replica leaving at acc[j] has run j - 1.
    j = 0
    cur = acc[0]
    last = len(acc) - 1
    while cur:
        if acc[last] == cur:
            run, gone = last, cur
            cur = 0
        else:
            j = bisect_right(acc, -cur, lo=j, key=neg)
            run, gone = j - 1, cur & ~acc[j]
            cur = acc[j]
        if run:
            while gone:
                low = gone & -gone
                runs[low.bit_length() - 1] = run
                gone ^= low
    return runs
