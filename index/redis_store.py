"""``RedisIndex``: a ``KVIndex`` in Redis (6.2+), shared by several routers.

Key layout 2 (``ns`` is the configured prefix without its trailing colon; a block key,
written ``<key>`` below, is its 64-bit value as 16 lowercase hex digits, most significant
first, so ``redis-cli`` shows and takes them as they are):

=============================  ======  ==================================================
key                            type    content
=============================  ======  ==================================================
``ns:meta``                    hash    ``next_rid`` (replica bit allocator), ``stride``,
                                       ``layout`` (``2``), ``epoch`` (random, set when the
                                       namespace is created)
``ns:rid`` / ``ns:rname``      hash    replica id <-> bit position (kept for the epoch)
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
* **Replica identity survives a reset.**  Bit positions are handed out by the first
  write of each replica, so after Redis restarts empty or is flushed they are handed
  out anew, in whatever order replicas write first (two routers may well register them
  in different orders).  The namespace's ``epoch`` names one such life: it is created
  with the namespace (``HSETNX``, so concurrent routers agree on one), every lookup reads
  it in the same script as the bitmaps, and the names cached for another epoch are
  re-read (with the epoch, in one transaction) before any bit is decoded; bits of an
  epoch are never reused, so names read later in the same epoch are a superset.  Every
  write passes the epoch this client knows: a write into another (or no) epoch is
  refused by the script, the client re-reads the namespace and raises ``IndexReset``
  (an ``IndexUnavailable``).  The client also remembers, per replica, the epoch its
  entries were (re)built in (the epoch of its first write, or of its last clear), and
  refuses with ``IndexReset`` a write for a replica built in an older epoch, except a
  clear, so *every* replica is rebuilt by its ingester (clear + replay,
  ``index.subscriber``), not only the first to write; ``stale(replica)`` tells an idle
  ingester the same (the epoch is re-read at most every ``epoch_check_s``).
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
import functools
import sys
import time
import uuid
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
from index.store import (
    AddByEngineKeyOp,
    AddOp,
    ClearOp,
    EvictOp,
    IndexOp,
    IndexReset,
    IndexUnavailable,
)
from kvkeys.types import EngineKey, Medium, PrefixHits, ReplicaId, RequestKey

__all__ = ["RedisIndex", "fail_fast_client"]

T = TypeVar("T")

_TIER: Final[dict[Medium, int]] = {Medium.GPU: 0, Medium.CPU: 1, Medium.STORAGE: 2}
# Redis numbers bits most-significant first within a byte; reversing every byte makes
# int.from_bytes(..., "little") put Redis bit p at int bit p.
_REVERSE: Final = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))
_LAYOUT: Final = "2"
_RESET_MARK: Final = "kvroute:reset"
"""What ``redis_apply.lua`` answers when the namespace is not the client's epoch."""


def fail_fast_client(url: str, *, connect_timeout_s: float) -> aioredis.Redis:
    """A client for ``url`` with no retries and no health checks: a failed call fails at
    once, and each caller bounds its calls with its own timeout (``asyncio.timeout``)."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=None,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


def _hex(keys: Sequence[int]) -> str:
    """64-bit keys as 16 hex digits each, most significant first, concatenated."""
    packed = array("Q", keys)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes().hex()


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


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
        epoch_check_s: float = 1.0,
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
        self._names_epoch: str | None = None
        """The epoch ``_names`` was read in."""
        self._clock = clock
        self._epoch: str | None = None
        """The epoch this client writes to (``None``: read the namespace first)."""
        self._built: dict[ReplicaId, str] = {}
        """Per replica, the epoch its entries were (re)built in through this client."""
        self._epoch_check = epoch_check_s
        self._epoch_read_at = -1e18
        self._epoch_seen: str | None = None
        """The epoch ``stale`` last read (``_epoch_known``: it did read one)."""
        self._epoch_known = False

    @classmethod
    def from_url(cls, url: str, *, op_timeout_s: float = 0.05, **kwargs: object) -> RedisIndex:
        """A client for ``url`` with no retries and timeouts that fail fast."""
        client = fail_fast_client(url, connect_timeout_s=max(op_timeout_s, 0.2))
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
        if self._epoch is not None:
            return
        meta = f"{self.ns}:meta"

        async def check() -> list[bytes | str | None]:
            fields = ["stride", "layout", "next_rid", "epoch"]
            found: list[bytes | str | None] = await self._r.hmget(meta, fields)
            if found[:3] == [None, None, None]:  # a new namespace (or a reset one)
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.hsetnx(meta, "stride", self._stride)
                    pipe.hsetnx(meta, "layout", _LAYOUT)
                    pipe.hsetnx(meta, "epoch", uuid.uuid4().hex)
                    pipe.hmget(meta, fields)
                    found = (await pipe.execute())[-1]
            return found

        stride, layout, _, epoch = await self._call(check, self._write_timeout)
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
        if epoch is None:  # created by a version without epochs

            async def add_epoch() -> bytes | str | None:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.hsetnx(meta, "epoch", uuid.uuid4().hex)
                    pipe.hget(meta, "epoch")
                    value: bytes | str | None = (await pipe.execute())[-1]
                    return value

            epoch = await self._call(add_epoch, self._write_timeout)
        self._epoch = _text(epoch)

    def _reset_seen(self) -> None:
        """The namespace is not the epoch this client knew: forget what depends on it."""
        self._epoch = None
        self._names, self._bits, self._names_epoch = [], {}, None
        self._names_at = -1e18

    async def stale(self, replica: ReplicaId) -> bool:
        """Whether ``replica``'s entries, built through this client, were lost to a reset
        of the namespace since (Redis restarted empty or flushed): its ingester must
        rebuild it.  The epoch is re-read at most every ``epoch_check_s``."""
        built = self._built.get(replica)
        if built is None:
            return False
        now = self._clock()
        if now - self._epoch_read_at >= self._epoch_check:
            self._epoch_read_at = now  # at most one attempt per period, failed or not
            raw = await self._call(
                lambda: self._r.hget(f"{self.ns}:meta", "epoch"), self._op_timeout
            )
            self._epoch_seen, self._epoch_known = _text(raw), True
            if self._epoch is not None and self._epoch_seen != self._epoch:
                self._reset_seen()
        return self._epoch_known and self._epoch_seen != built

    async def _refresh_names(self) -> None:
        async def read() -> list[object]:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.hget(f"{self.ns}:meta", "epoch")
                pipe.hgetall(f"{self.ns}:rname")
                found: list[object] = await pipe.execute()
                return found

        epoch_raw, raw_names = await self._call(read, self._op_timeout)
        raw: dict[bytes | str, bytes | str] = raw_names  # type: ignore[assignment]
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
        self._names_epoch = _text(epoch_raw)  # type: ignore[arg-type]
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
        epoch_raw, blob = await self._call(
            lambda: self._lookup(keys=[], args=[pre, arg, f"{self.ns}:meta"]), self._op_timeout
        )
        if not blob:
            return PrefixHits()
        epoch = _text(epoch_raw)
        if epoch != self._names_epoch:
            # Bits were handed out in another life of the namespace: names first.
            await self._refresh_names()
            if epoch != self._names_epoch:
                return PrefixHits()  # reset again in between: no information
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
        """Apply ``ops`` in order as one atomic script call; ``IndexReset`` if the
        namespace was reset since ``replica`` was built (unless ``ops`` clear it)."""
        if not ops:
            return
        rebuilds = any(isinstance(op, ClearOp) for op in ops)
        body = self._encode(ops)
        for attempt in (0, 1):
            await self._check_meta()
            epoch = self._epoch
            assert epoch is not None
            built = self._built.get(replica)
            if built is not None and built != epoch and not rebuilds:
                raise IndexReset(f"redis namespace {self.ns!r} was reset since {replica} "
                                 "was indexed: rebuild it")  # fmt: skip
            args: list[str | int] = [self.ns, replica, self._stride, self._ttl, epoch, *body]
            try:
                await self._call(functools.partial(self._apply, args=args), self._write_timeout)
            except IndexUnavailable as exc:
                if _RESET_MARK not in str(exc):
                    raise
                self._reset_seen()
                if rebuilds and attempt == 0:
                    continue  # a clear may go into the new epoch at once
                raise IndexReset(f"redis namespace {self.ns!r} was reset (restart or "
                                 "flush): rebuild") from exc  # fmt: skip
            if rebuilds or built is None:
                self._built[replica] = epoch
            return

    def _encode(self, ops: Sequence[IndexOp]) -> list[str | int]:
        args: list[str | int] = []
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
        return args

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
