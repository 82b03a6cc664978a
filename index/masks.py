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
    v = values[0]
    active = (v | v >> s | v >> 2 * s) & lim & allowed
    if not active:
        return PrefixHits()
    if max(values) <= lim:
        return _scan_gpu_only(values, active, ids)
    runs: dict[int, int] = {}
    slow: dict[int, list[int]] | None = None  # bit -> [cpu, storage] blocks
    n = len(values)
    for i, v in enumerate(values):
        if v & active == active and v <= lim:
            continue  # the hot path: every active replica holds it on GPU
        if v <= lim:
            held = v
            offload = 0
        else:
            held = (v | v >> s | v >> 2 * s) & lim
            offload = active & held & ~v
        still = active & held
        if still != active:
            gone = active & ~still
            while gone:
                low = gone & -gone
                runs[low.bit_length() - 1] = i
                gone ^= low
            active = still
            if not active:
                break
        if offload:
            if slow is None:
                slow = {}
            cpu = v >> s
            while offload:
                low = offload & -offload
                b = low.bit_length() - 1
                c = slow.setdefault(b, [0, 0])
                c[0 if cpu & low else 1] += 1
                offload ^= low
    while active:
        low = active & -active
        runs[low.bit_length() - 1] = n
        active ^= low
    out: dict[ReplicaId, ReplicaHit] = {}
    n_ids = len(ids)
    for b, run in runs.items():
        if run == 0 or b >= n_ids:
            continue
        if slow is not None and b in slow:
            cpu_n, sto_n = slow[b]
            out[ids[b]] = ReplicaHit(run - cpu_n - sto_n, cpu_n, sto_n)
        else:
            out[ids[b]] = ReplicaHit(run)
    return PrefixHits(out)


def _scan_gpu_only(values: Sequence[int], active: int, ids: Sequence[ReplicaId]) -> PrefixHits:
    """Every value is a plain GPU mask: the running AND (computed in C) is non-increasing
    (each value a submask of the previous), so each drop is found by bisection."""
    acc = list(accumulate(values, and_, initial=active))
    # acc[i] = replicas holding blocks 0..i-1; a replica leaving at acc[j] has run j - 1.
    out: dict[ReplicaId, ReplicaHit] = {}
    n_ids = len(ids)
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
                b = low.bit_length() - 1
                if b < n_ids:
                    out[ids[b]] = ReplicaHit(run)
                gone ^= low
    return PrefixHits(out)
