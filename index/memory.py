"""``InMemoryIndex``: the embedded ``KVIndex``, a few dicts on the event loop.

Layout (chosen for lookup speed and memory, see ``bench/index_bench.py``):

* Each replica gets a bit position ``b`` on first sight (kept for the index's lifetime).
* ``_masks[request_key]`` is the key's holder mask (``index.masks``): replicas holding
  it in any tier, those whose fastest copy is in CPU memory, and those holding it only
  in storage, ``held | cpu_first << S | storage_first << 2S``, where ``S`` (the stride)
  grows, with a repack, when replicas outnumber it.  A lookup is one dict probe per key
  (``map`` over the keys, in C) and ``index.masks.scan_masks``, independent of the number
  of replicas; tiers are counted per replica only where some replica's fastest copy is
  off GPU.
* Per replica, ``_Replica.engine[engine_key]`` packs the request key and that engine
  key's reference counts per tier (``request_key | gpu << 64 | cpu << 84 | storage <<
  104``), and ``_Replica.request[request_key]`` packs the per-tier reference counts of the
  request key (several engine keys can map to one request key, e.g. vLLM 0.33's lookahead
  hashing).  The replica's bits in the holder mask follow those counts: held while any
  is positive, off-GPU-first while the GPU count is zero.
* Reference counts make ``add`` and ``evict`` exact under vLLM's duplicate stores
  (``BlockHashToBlockMap`` holds one hash several times).  Counts saturate at 2**20 - 1.
* An engine key stays mapped while any tier of it is referenced, so token-less offload
  stores (``add_by_engine_key``) and children of the block (``request_key``) resolve.

No method awaits, so each is atomic on the event loop; there are no locks.  Not bounded in
size: the engine's own evictions (``BlockRemoved``) bound it, and a replica's state goes
with ``clear``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Final

from index.masks import scan_masks
from index.store import AddByEngineKeyOp, AddOp, ClearOp, EvictOp, IndexOp
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey

__all__ = ["InMemoryIndex"]

_U64: Final = (1 << 64) - 1
_CNT_BITS: Final = 20
_CNT_MAX: Final = (1 << _CNT_BITS) - 1
_TIER: Final[dict[Medium, int]] = {Medium.GPU: 0, Medium.CPU: 1, Medium.STORAGE: 2}
# Engine entry: request key in bits 0..63, then three 20-bit counts.
_E_SHIFT: Final = (64, 64 + _CNT_BITS, 64 + 2 * _CNT_BITS)
# Request entry: three 20-bit counts.
_R_SHIFT: Final = (0, _CNT_BITS, 2 * _CNT_BITS)


@dataclass(slots=True)
class _Replica:
    bit: int
    engine: dict[EngineKey, int] = field(default_factory=dict)
    request: dict[RequestKey, int] = field(default_factory=dict)


class InMemoryIndex:
    """A ``KVIndex`` held in this process (the default for a single router)."""

    def __init__(self, *, stride: int = 64) -> None:
        self._stride = stride
        self._masks: dict[RequestKey, int] = {}
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._ids: list[ReplicaId] = []

    # ------------------------------------------------------------------ helpers

    def _replica(self, replica: ReplicaId) -> _Replica:
        r = self._replicas.get(replica)
        if r is None:
            if len(self._ids) == self._stride:
                self._repack(self._stride * 2)
            r = _Replica(bit=len(self._ids))
            self._ids.append(replica)
            self._replicas[replica] = r
        return r

    def _repack(self, stride: int) -> None:
        old, lim = self._stride, (1 << self._stride) - 1
        for k, v in self._masks.items():
            self._masks[k] = (
                (v & lim) | ((v >> old) & lim) << stride | (v >> 2 * old) << (2 * stride)
            )
        self._stride = stride

    def _sync(self, key: RequestKey, bit: int, counts: int) -> None:
        """Set replica ``bit``'s part of ``key``'s holder mask from its per-tier counts."""
        s = self._stride
        one = 1 << bit
        if counts & _CNT_MAX:
            want = one
        elif (counts >> _CNT_BITS) & _CNT_MAX:
            want = one | one << s
        elif counts >> 2 * _CNT_BITS:
            want = one | one << 2 * s
        else:
            want = 0
        v = (self._masks.get(key, 0) & ~(one | one << s | one << 2 * s)) | want
        if v:
            self._masks[key] = v
        else:
            self._masks.pop(key, None)

    def _ref(self, r: _Replica, ek: EngineKey, rk: RequestKey, tier: int) -> None:
        e = r.engine.get(ek)
        if e is not None and e & _U64 != rk:
            # The engine reused a hash for other content (a collision, or a restart
            # nobody told us about): forget the old mapping entirely.
            self._drop_engine(r, ek, e)
            e = None
        eshift = _E_SHIFT[tier]
        if e is None:
            e = rk
        if (e >> eshift) & _CNT_MAX == _CNT_MAX:
            return
        r.engine[ek] = e + (1 << eshift)
        rshift = _R_SHIFT[tier]
        q = r.request.get(rk, 0)
        r.request[rk] = q + (1 << rshift)
        if (q >> rshift) & _CNT_MAX == 0:
            self._sync(rk, r.bit, q + (1 << rshift))

    def _unref(self, r: _Replica, rk: RequestKey, tier: int, n: int) -> None:
        rshift = _R_SHIFT[tier]
        q = r.request.get(rk, 0)
        cnt = (q >> rshift) & _CNT_MAX
        n = min(n, cnt)
        q -= n << rshift
        if q:
            r.request[rk] = q
        else:
            r.request.pop(rk, None)
        if n and n == cnt:
            self._sync(rk, r.bit, q)

    def _drop_engine(self, r: _Replica, ek: EngineKey, e: int) -> None:
        rk = RequestKey(e & _U64)
        for tier in range(3):
            n = (e >> _E_SHIFT[tier]) & _CNT_MAX
            if n:
                self._unref(r, rk, tier, n)
        del r.engine[ek]

    # ------------------------------------------------------------------ KVIndex

    async def lookup(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        """Per replica, the consecutive leading blocks of ``keys`` it holds, and where."""
        return self.lookup_sync(keys, among=among)

    def lookup_sync(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        """``lookup`` without the coroutine (same answer; for benchmarks and sync callers)."""
        if not keys:
            return PrefixHits()
        masks = self._masks
        s = self._stride
        lim = (1 << s) - 1
        if among is None:
            allowed = lim
        else:
            allowed = 0
            for rid in among:
                r = self._replicas.get(rid)
                if r is not None:
                    allowed |= 1 << r.bit
        return scan_masks(map(masks.get, keys, repeat(0, len(keys))), allowed, s, self._ids)

    async def add(
        self,
        replica: ReplicaId,
        engine_keys: Sequence[EngineKey],
        request_keys: Sequence[RequestKey],
        medium: Medium = Medium.GPU,
    ) -> None:
        """Record that ``replica`` stored these blocks (pairwise) in ``medium``."""
        self.add_sync(replica, engine_keys, request_keys, medium)

    def add_sync(
        self,
        replica: ReplicaId,
        engine_keys: Sequence[EngineKey],
        request_keys: Sequence[RequestKey],
        medium: Medium = Medium.GPU,
    ) -> None:
        """``add`` without the coroutine."""
        if len(engine_keys) != len(request_keys):
            raise ValueError("engine_keys and request_keys differ in length")
        if not engine_keys:
            return
        r = self._replica(replica)
        tier = _TIER[medium]
        eshift, rshift = _E_SHIFT[tier], _R_SHIFT[tier]
        one_e, one_r = 1 << eshift, 1 << rshift
        s = self._stride
        bit = 1 << r.bit
        lim = (1 << s) - 1
        off_bits = bit << s | bit << 2 * s
        eng, req, masks = r.engine, r.request, self._masks
        # ``_ref`` inlined for the common cases (ingest speed); the rare ones call it.
        for ek, rk in zip(engine_keys, request_keys, strict=True):
            e = eng.get(ek)
            if e is None:
                eng[ek] = rk + one_e
            elif e & _U64 == rk and (e >> eshift) & _CNT_MAX != _CNT_MAX:
                eng[ek] = e + one_e
            else:
                self._ref(r, ek, rk, tier)
                continue
            q = req.get(rk, 0)
            req[rk] = q + one_r
            if not (q >> rshift) & _CNT_MAX:
                if tier:
                    self._sync(rk, r.bit, q + one_r)
                else:  # now on GPU here: held, and no longer off-GPU-first
                    m = masks.get(rk, 0)
                    masks[rk] = (m & ~off_bits if m > lim else m) | bit

    async def add_by_engine_key(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium
    ) -> int:
        """Record a token-less store for known engine keys; return how many resolved."""
        return self._add_by_engine_key(replica, engine_keys, medium)

    def _add_by_engine_key(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium
    ) -> int:
        r = self._replicas.get(replica)
        if r is None:
            return 0
        tier = _TIER[medium]
        resolved = 0
        for ek in engine_keys:
            e = r.engine.get(ek)
            if e is not None:
                self._ref(r, ek, RequestKey(e & _U64), tier)
                resolved += 1
        return resolved

    async def evict(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium = Medium.GPU
    ) -> None:
        """Drop one reference per key in ``medium``; unknown keys are ignored."""
        self.evict_sync(replica, engine_keys, medium)

    def evict_sync(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium = Medium.GPU
    ) -> None:
        """``evict`` without the coroutine."""
        r = self._replicas.get(replica)
        if r is None:
            return
        tier = _TIER[medium]
        eshift = _E_SHIFT[tier]
        for ek in engine_keys:
            e = r.engine.get(ek)
            if e is None or (e >> eshift) & _CNT_MAX == 0:
                continue
            e -= 1 << eshift
            rk = RequestKey(e & _U64)
            self._unref(r, rk, tier, 1)
            if e >> 64:
                r.engine[ek] = e
            else:
                del r.engine[ek]

    async def request_key(self, replica: ReplicaId, engine_key: EngineKey) -> RequestKey | None:
        """The request key ``replica`` stored under ``engine_key``, if any."""
        return self.request_key_sync(replica, engine_key)

    def request_key_sync(self, replica: ReplicaId, engine_key: EngineKey) -> RequestKey | None:
        """``request_key`` without the coroutine."""
        r = self._replicas.get(replica)
        if r is None:
            return None
        e = r.engine.get(engine_key)
        return None if e is None else RequestKey(e & _U64)

    async def request_keys(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey]
    ) -> list[RequestKey | None]:
        """``request_key`` for several engine keys."""
        r = self._replicas.get(replica)
        if r is None:
            return [None] * len(engine_keys)
        get = r.engine.get
        out: list[RequestKey | None] = []
        for ek in engine_keys:
            e = get(ek)
            out.append(None if e is None else RequestKey(e & _U64))
        return out

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        """Apply ``ops`` in order (atomic: nothing awaits in between)."""
        self.apply_sync(replica, ops)

    def apply_sync(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        """``apply`` without the coroutine."""
        for op in ops:
            if isinstance(op, AddOp):
                self.add_sync(replica, op.engine_keys, op.request_keys, op.medium)
            elif isinstance(op, EvictOp):
                self.evict_sync(replica, op.engine_keys, op.medium)
            elif isinstance(op, AddByEngineKeyOp):
                self._add_by_engine_key(replica, op.engine_keys, op.medium)
            elif isinstance(op, ClearOp):
                self.clear_sync(replica)

    async def clear(self, replica: ReplicaId) -> None:
        """Forget everything ``replica`` holds."""
        self.clear_sync(replica)

    def clear_sync(self, replica: ReplicaId) -> None:
        """``clear`` without the coroutine."""
        r = self._replicas.get(replica)
        if r is None:
            return
        s = self._stride
        keep = ~((1 << r.bit) | (1 << (r.bit + s)) | (1 << (r.bit + 2 * s)))
        masks = self._masks
        for rk in r.request:
            v = masks.get(rk, 0) & keep
            if v:
                masks[rk] = v
            else:
                masks.pop(rk, None)
        r.request = {}
        r.engine = {}

    async def replicas(self) -> set[ReplicaId]:
        """Replicas that hold at least one block."""
        return {rid for rid, r in self._replicas.items() if r.request}

    def blocks(self, replica: ReplicaId) -> int:
        """Distinct request keys ``replica`` holds in any tier (for metrics)."""
        r = self._replicas.get(replica)
        return 0 if r is None else len(r.request)

    async def aclose(self) -> None:
        """Drop everything (nothing to release)."""
        self._masks.clear()
        self._replicas.clear()
        self._ids.clear()
