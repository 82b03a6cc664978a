"""``RedisIndex``: a ``KVIndex`` in Redis (6.2+), shared by several routers.

Key layout 2 (``ns`` is the configured prefix without its trailing colon; a block key,
written ``<key>`` below, is its 64-bit value as 16 lowercase hex digits, most significant
first, so ``redis-cli`` shows and takes them as they are):

=============================  ======  ==================================================
key                            type    content
=============================  ======  ==================================================
``ns:meta``                    hash    ``next_rid`` (replica bit allocator), ``stride``,
                                       ``layout`` (``2``)
``ns:rid`` / ``ns:rname``      hash    replica id <-> bit position (kept for good)
``ns:m:<request key>``         string  tier bitmap: bit ``tier * stride + rid`` (SETBIT
                                       order) set while the replica holds the block in that
                                       tier (0 GPU, 1 CPU, 2 STORAGE); deleted when empty
``ns:e:<replica>``             hash    ``<engine key>`` -> ``"<request key> <gpu> <cpu>
                                       <storage>"`` (the engine key's reference counts)
``ns:r:<replica>``             hash    ``<request key><tier>`` -> reference count (how many
                                       engine keys hold the request key in that tier)
``ns:lease:<replica>``         string  ingestion lease (``index.lease``)
``ns:status:<replica>``        string  JSON ``SourceStatus`` published by the lease owner
=============================  ======  ==================================================

Contracts:

* **One round trip per lookup**: a Lua script (``redis_lookup.lua``) returns the bitmaps
  of the prompt's keys up to the first key nobody holds, run-length encoded (holders
  change only where some replica's prefix ends), as one string; the keys go in as one
  argument.  The pure-Python client thus encodes and parses a few values, not 800, and
  the prefix scan runs here (``index.masks.scan_runs``).  Replica names are cached
  locally and refreshed when an unknown bit appears (a new replica: one extra round
  trip, once).
* **Atomic updates**: ``apply`` sends one event batch's operations as one Lua script call
  (``redis_apply.lua``), each operation's keys as one argument; readers see a batch
  entirely or not at all.
* **Bounded memory**: every key written carries a TTL (``ttl_s``, default one day): a
  block's bitmap is refreshed whenever a replica newly holds it in a tier, a replica's
  hashes whenever its events are applied.  So the state of a replica nobody ingests any
  more, or of a block nobody stores any more, disappears on its own; the engines' own
  evictions (``BlockRemoved``) bound it in steady state.  Run Redis with ``maxmemory``
  and ``maxmemory-policy volatile-lru`` as the hard bound: evicting a bitmap only loses hits
  (safe); evicting a replica's hashes lets its later removals go unapplied until the
  bitmaps' TTL, so size ``maxmemory`` with headroom (``bench/index_bench.py`` prints the
  bytes per block).
* **Unavailable**: each call runs under a timeout (``op_timeout_s`` for lookups,
  ``write_timeout_s`` for writes) with no retries; connection errors and timeouts raise
  ``IndexUnavailable``.  The client reconnects by itself on the next call.
* Not Redis Cluster compatible (the scripts build key names); use one primary.
  Bitmaps are at most 255 bytes, so ``max_replicas`` is at most 680.
* ``max_replicas`` (the stride, default 256) is fixed per namespace: event sources, DP
  ranks included, that have ever written to it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Collection, Sequence
from importlib import resources
from typing import Final, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from aio.cancel import reraise_if_cancelling
from index.masks import holder_mask, scan_runs
from index.store import AddByEngineKeyOp, AddOp, ClearOp, EvictOp, IndexOp, IndexUnavailable
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey

__all__ = ["RedisIndex"]

T = TypeVar("T")

_TIER: Final[dict[Medium, int]] = {Medium.GPU: 0, Medium.CPU: 1, Medium.STORAGE: 2}
# Redis numbers bits most-significant first within a byte; reversing every byte makes
# int.from_bytes(..., "little") put Redis bit p at int bit p.
_REVERSE: Final = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))
_LAYOUT: Final = "2"


def _hex(keys: Sequence[int]) -> str:
    """64-bit keys as 16 hex digits each, most significant first, concatenated."""
    packed = array("Q", keys)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes().hex()


def _script(name: str) -> str:
    return resources.files("index").joinpath(name).read_text()


class RedisIndex:
    """A ``KVIndex`` stored in Redis."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = "kvroute:",
        op_timeout_s: float = 0.05,
        write_timeout_s: float = 5.0,
        ttl_s: int = 86_400,
        max_replicas: int = 256,
        names_refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._r = client
        self.ns = key_prefix.rstrip(":")
        self._op_timeout = op_timeout_s
        self._write_timeout = write_timeout_s
        self._ttl = ttl_s
        if not 0 < max_replicas <= 680:
            raise ValueError("max_replicas must be in 1..680 (3 tiers x 680 bits <= 255 bytes)")
        self._stride = max_replicas
        self._lim = (1 << max_replicas) - 1
        self._apply = client.register_script(_script("redis_apply.lua"))
        self._lookup = client.register_script(_script("redis_lookup.lua"))
        self._bits: dict[ReplicaId, int] = {}
        self._names: list[ReplicaId] = []
        self._names_at = -1e18
        self._names_refresh = names_refresh_s
        self._clock = clock
        self._meta_checked = False

    @classmethod
    def from_url(cls, url: str, *, op_timeout_s: float = 0.05, **kwargs: object) -> RedisIndex:
        """A client for ``url`` with no retries and timeouts that fail fast."""
        client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=max(op_timeout_s, 0.2),
            socket_timeout=None,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        return cls(client, op_timeout_s=op_timeout_s, **kwargs)  # type: ignore[arg-type]

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client (shared with ``index.lease`` and status publication)."""
        return self._r

    def key(self, kind: str, name: str) -> str:
        """``ns:<kind>:<name>`` (see the key layout above)."""
        return f"{self.ns}:{kind}:{name}"

    async def _call(self, aw: Callable[[], Awaitable[T]], timeout: float) -> T:
        try:
            async with asyncio.timeout(timeout):
                return await aw()
        except TimeoutError as exc:
            reraise_if_cancelling()
            raise IndexUnavailable(f"redis did not answer within {timeout:g} s") from exc
        except (RedisError, OSError) as exc:
            reraise_if_cancelling()
            raise IndexUnavailable(f"redis: {exc}") from exc

    async def check_namespace(self) -> None:
        """Create the namespace's metadata, or check it matches this client: raises
        ``ValueError`` for another ``max_replicas`` or key layout, ``IndexUnavailable``
        if Redis cannot answer.  The first write also checks it."""
        await self._check_meta()

    async def _check_meta(self) -> None:
        if self._meta_checked:
            return
        meta = f"{self.ns}:meta"

        async def check() -> list[bytes | str | None]:
            found: list[bytes | str | None] = await self._r.hmget(
                meta, ["stride", "layout", "next_rid"]
            )
            if found == [None, None, None]:  # a new namespace
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.hsetnx(meta, "stride", self._stride)
                    pipe.hsetnx(meta, "layout", _LAYOUT)
                    pipe.hmget(meta, ["stride", "layout", "next_rid"])
                    found = (await pipe.execute())[-1]
            return found

        stride, layout, _ = await self._call(check, self._write_timeout)
        if stride is not None and int(stride) != self._stride:
            raise ValueError(
                f"namespace {self.ns!r} was created with max_replicas={int(stride)}, "
                f"not {self._stride}"
            )
        if layout is None or int(layout) != int(_LAYOUT):
            raise ValueError(
                f"namespace {self.ns!r} holds another kvroute key layout ({layout!r}; this "
                f"version writes layout {_LAYOUT}): use a new key_prefix or delete the namespace"
            )
        self._meta_checked = True

    async def _refresh_names(self) -> None:
        raw: dict[bytes | str, bytes | str] = await self._call(
            lambda: self._r.hgetall(f"{self.ns}:rname"), self._op_timeout
        )
        names: list[ReplicaId] = []
        bits: dict[ReplicaId, int] = {}
        for b, n in raw.items():
            bit = int(b)
            while len(names) <= bit:
                names.append(ReplicaId(""))
            rid = ReplicaId(n.decode() if isinstance(n, bytes) else n)
            names[bit] = rid
            bits[rid] = bit
        self._names, self._bits = names, bits
        self._names_at = self._clock()

    # ------------------------------------------------------------------ reads

    async def lookup(
        self, keys: Sequence[RequestKey], *, among: Collection[ReplicaId] | None = None
    ) -> PrefixHits:
        """Per replica, the consecutive leading blocks of ``keys`` it holds (one round
        trip; raises ``IndexUnavailable``)."""
        if not keys:
            return PrefixHits()
        pre = f"{self.ns}:m:"
        arg = _hex(keys)
        blob: bytes = await self._call(
            lambda: self._lookup(keys=[], args=[pre, arg]), self._op_timeout
        )
        if not blob:
            return PrefixHits()
        s, lim = self._stride, self._lim
        rev = _REVERSE
        runs: list[tuple[int, int]] = []
        seen = 0
        pos, end = 0, len(blob)
        while pos < end:
            count = int.from_bytes(blob[pos : pos + 3], "big")
            n = blob[pos + 3]
            tiers = int.from_bytes(blob[pos + 4 : pos + 4 + n].translate(rev), "little")
            mask = holder_mask(tiers & lim, tiers >> s & lim, tiers >> 2 * s, s)
            seen |= mask
            runs.append((count, mask))
            pos += 4 + n
        seen &= lim
        if seen >> len(self._names) or (
            among is not None
            and any(r not in self._bits for r in among)
            and self._clock() - self._names_at > self._names_refresh
        ):
            await self._refresh_names()
        if among is None:
            allowed = self._lim
        else:
            allowed = 0
            for rid in among:
                bit = self._bits.get(rid)
                if bit is not None:
                    allowed |= 1 << bit
        return scan_runs(runs, allowed, self._stride, self._names)

    async def request_key(self, replica: ReplicaId, engine_key: EngineKey) -> RequestKey | None:
        """The request key ``replica`` stored under ``engine_key``, if any."""
        return (await self.request_keys(replica, [engine_key]))[0]

    async def request_keys(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey]
    ) -> list[RequestKey | None]:
        """``request_key`` for several engine keys in one round trip."""
        if not engine_keys:
            return []
        ekey = self.key("e", replica)
        h = _hex(engine_keys)
        fields = [h[i : i + 16] for i in range(0, len(h), 16)]
        raw: list[bytes | str | None] = await self._call(
            lambda: self._r.hmget(ekey, fields), self._write_timeout
        )
        return [None if v is None else RequestKey(int(v[:16], 16)) for v in raw]

    async def replicas(self) -> set[ReplicaId]:
        """Replicas that hold at least one block."""
        await self._refresh_names()
        names = [n for n in self._names if n]
        if not names:
            return set()

        async def sizes() -> list[int]:
            async with self._r.pipeline(transaction=False) as pipe:
                for n in names:
                    pipe.hlen(self.key("r", n))
                result: list[int] = await pipe.execute()
                return result

        counts = await self._call(sizes, self._write_timeout)
        return {n for n, c in zip(names, counts, strict=True) if c}

    async def blocks(self, replica: ReplicaId) -> int:
        """Request keys ``replica`` holds, counted once per tier (for metrics)."""
        count: int = await self._call(
            lambda: self._r.hlen(self.key("r", replica)), self._op_timeout
        )
        return count

    # ------------------------------------------------------------------ writes

    async def apply(self, replica: ReplicaId, ops: Sequence[IndexOp]) -> None:
        """Apply ``ops`` in order as one atomic script call."""
        if not ops:
            return
        await self._check_meta()
        args: list[str | int] = [self.ns, replica, self._stride, self._ttl]
        for op in ops:
            if isinstance(op, AddOp):
                if len(op.engine_keys) != len(op.request_keys):
                    raise ValueError("engine_keys and request_keys differ in length")
                args += ("a", _TIER[op.medium], len(op.engine_keys),
                         _hex(op.engine_keys), _hex(op.request_keys))  # fmt: skip
            elif isinstance(op, AddByEngineKeyOp):
                args += ("k", _TIER[op.medium], len(op.engine_keys), _hex(op.engine_keys))
            elif isinstance(op, EvictOp):
                args += ("e", _TIER[op.medium], len(op.engine_keys), _hex(op.engine_keys))
            elif isinstance(op, ClearOp):
                args += ("c", 0, 0)
        await self._call(lambda: self._apply(args=args), self._write_timeout)

    async def add(
        self,
        replica: ReplicaId,
        engine_keys: Sequence[EngineKey],
        request_keys: Sequence[RequestKey],
        medium: Medium = Medium.GPU,
    ) -> None:
        """Record that ``replica`` stored these blocks (pairwise) in ``medium``."""
        if len(engine_keys) != len(request_keys):
            raise ValueError("engine_keys and request_keys differ in length")
        if engine_keys:
            await self.apply(replica, [AddOp(engine_keys, request_keys, medium)])

    async def add_by_engine_key(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium
    ) -> int:
        """Record a token-less store for known engine keys; return how many resolved."""
        if not engine_keys:
            return 0
        known = await self.request_keys(replica, engine_keys)
        await self.apply(replica, [AddByEngineKeyOp(engine_keys, medium)])
        return sum(1 for k in known if k is not None)

    async def evict(
        self, replica: ReplicaId, engine_keys: Sequence[EngineKey], medium: Medium = Medium.GPU
    ) -> None:
        """Drop one reference per key in ``medium``; unknown keys are ignored."""
        if engine_keys:
            await self.apply(replica, [EvictOp(engine_keys, medium)])

    async def clear(self, replica: ReplicaId) -> None:
        """Forget everything ``replica`` holds."""
        await self.apply(replica, [ClearOp()])

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self._r.aclose()
