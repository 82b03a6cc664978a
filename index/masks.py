"""The prefix scan shared by the index backends: holder masks in, ``PrefixHits`` out.

Each block key's holders are one int, its **holder mask**, made of three bitmasks over
replica bit positions, ``held | cpu_first << S | storage_first << 2S`` (``S``, the
stride, is the backend's replica capacity):

* ``held``: the replicas that hold the block in some tier;
* ``cpu_first``: those whose fastest copy is in CPU memory (no GPU copy);
* ``storage_first``: those that hold it only in storage (no GPU or CPU copy).

So a block every holder keeps on GPU has a mask below ``2**S``, and a lookup counts
each block in its fastest tier without looking at the slower ones (``holder_mask``
builds the mask from per-tier bitmasks).

``scan_masks`` takes the masks of a prompt's keys in order; ``scan_runs`` takes them
run-length encoded (``(count, mask)`` pairs, as the Redis store receives them).  Keys are
chained, so a replica's hit stops at its first miss, and the holders of consecutive keys
change only where some replica's cached prefix ends or changes tier.  So the scan visits
only the runs of equal masks, which ``itertools.groupby`` finds in C, and the Python work
is per run: the replicas that drop out there end their hit, and the run's length is
added to its pattern of off-GPU holders (split per replica once, at the end).  A prompt
fully cached on GPU by every holder is one run, and the scan stops reading at the run
where the last hit ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import groupby

from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId

__all__ = ["holder_mask", "scan_masks", "scan_runs"]

# ``ReplicaHit``s are immutable values: a lookup hands out shared ones (a frozen
# dataclass costs about half a microsecond to build; a lookup builds one per replica).
_hit: Callable[[int, int, int], ReplicaHit] = lru_cache(maxsize=8192)(ReplicaHit)


def holder_mask(gpu: int, cpu: int, storage: int, stride: int) -> int:
    """The holder mask of a block from the replicas holding it in each tier."""
    cpu_first = cpu & ~gpu
    storage_first = storage & ~gpu & ~cpu
    return (gpu | cpu | storage) | cpu_first << stride | storage_first << 2 * stride


def scan_masks(
    values: Iterable[int], allowed: int, stride: int, ids: Sequence[ReplicaId]
) -> PrefixHits:
    """Per replica, the consecutive leading blocks held among ``allowed`` replicas.

    ``values`` are the holder masks of the prompt's blocks in order (0 where nobody holds
    one); ``ids[b]`` names the replica at bit ``b`` (bits without a name are ignored).
    ``values`` may be lazy: nothing past the block where the last hit ends is read."""
    return scan_runs(_runs(values, allowed & ((1 << stride) - 1)), allowed, stride, ids)


def _runs(values: Iterable[int], active: int) -> Iterator[tuple[int, int]]:
    """``values`` as ``(count, mask)`` runs, up to the run that no replica of ``active``
    (the allowed replica bits) holds into: there every hit has ended, so that run is
    not counted (``scan_runs`` reads only its mask) and nothing after it is read."""
    for mask, same in groupby(values):
        active &= mask
        if not active:
            yield 0, mask
            return
        yield len(list(same)), mask


def scan_runs(
    runs: Iterable[tuple[int, int]], allowed: int, stride: int, ids: Sequence[ReplicaId]
) -> PrefixHits:
    """``scan_masks`` over ``(count, mask)`` runs: ``count`` consecutive blocks with the
    holder mask ``mask``."""
    lim = (1 << stride) - 1
    active = allowed & lim
    hits: dict[int, int] = {}  # bit -> leading blocks held
    # Off-GPU blocks, summed per pattern: (CPU-first | storage-first << S) among the
    # replicas still in their run -> blocks; split per replica once, at the end.
    slow: dict[int, int] = {}
    pos = 0
    for count, mask in runs:
        still = active & mask
        if still != active:
            gone = active ^ still
            while gone:
                low = gone & -gone
                hits[low.bit_length() - 1] = pos
                gone ^= low
            active = still
            if not active:
                break
        if mask > lim:
            pattern = mask >> stride & (active | active << stride)
            slow[pattern] = slow.get(pattern, 0) + count
        pos += count
    while active:
        low = active & -active
        hits[low.bit_length() - 1] = pos
        active ^= low
    off: dict[int, list[int]] = {}  # bit -> [CPU-first, storage-first] blocks of its run
    for pattern, count in slow.items():
        for tier, bits in ((0, pattern & lim), (1, pattern >> stride)):
            while bits:
                low = bits & -bits
                b = low.bit_length() - 1
                counts = off.get(b)
                if counts is None:
                    counts = off[b] = [0, 0]
                counts[tier] += count
                bits ^= low
    out: dict[ReplicaId, ReplicaHit] = {}
    n_ids = len(ids)
    for b, held in hits.items():
        if not held or b >= n_ids:
            continue
        counts = off.get(b)
        if counts is None:
            out[ids[b]] = _hit(held, 0, 0)
        else:
            out[ids[b]] = _hit(held - counts[0] - counts[1], counts[0], counts[1])
    return PrefixHits(out)
