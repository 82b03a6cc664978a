"""``KVEventIngestion``: every replica's KV events into one index, as one owned task.

The router's lifespan (and ``kvroute indexer``) builds one ``KVEventIngestion`` and runs
it as a single background task; cancelling that task stops every subscriber and closes
every socket.  Inside, every source (configured replica, discovered DP rank, bound
endpoint) runs under a ``Supervisor`` (``aio.supervisor``): a source whose subscriber
fails is logged, counted and restarted with a backoff (a new subscriber: clear + replay
from 0), and never stops another source; ``health()`` says which failed recently::

    ingestion = KVEventIngestion(index, specs, http=session)
    task = tasks.spawn(ingestion.run(), name="kv-events")
    ...
    ingestion.statuses()        # {source id: SourceStatus}, read by scoring
    ingestion.health()          # SupervisorHealth: ok, failing, restarts

Each ``SourceSpec`` is one replica as configured:

* ``endpoint`` given: connect a SUB to it (``replay_endpoint`` optional);
* otherwise ``url`` given: discover the replica's streams from ``GET /kv_event_sources``
  (retried with backoff until it answers; a 404 is retried slowly), one source per DP
  rank; the model comes from ``model`` or ``/v1/models``;
* ``BindSpec``: one bound SUB with a topic -> source mapping (engines connect to us).

With ``lease`` settings (a shared Redis index), every source (or bound endpoint) is
ingested only while this process holds its lease (``index.lease``); the holder publishes
the source's ``SourceStatus`` to Redis and ``statuses()`` includes what other holders
published for the sources this process does not ingest.

A source whose stream stays lost for ``SubscriberSettings.disconnect_grace_s`` (a dead
engine) is cleared from the index by the process that ingests it (the lease holder),
turns ``disconnected`` and is rebuilt from sequence 0 when it comes back; standby
processes never clear (see ``index.subscriber`` for what bind mode detects).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import zmq.asyncio
from redis.exceptions import RedisError

from aio.backoff import Backoff
from aio.cancel import reraise_if_cancelling
from aio.supervisor import Child, Supervisor, SupervisorHealth
from index.discovery import DiscoveryError, discover_model, discover_sources
from index.lease import RedisLease, run_with_lease
from index.status import SourceStatus, status_from_json, status_to_json
from index.store import KVIndex
from index.subscriber import (
    BindSubscriber,
    ConnectSubscriber,
    EventSource,
    IngestObserver,
    SubscriberSettings,
)
from kvkeys.types import ReplicaId

__all__ = ["BindSpec", "KVEventIngestion", "LeaseSettings", "SourceSpec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One configured replica."""

    replica: ReplicaId
    model: str | None = None
    """Base model (key root); ``None``: ask ``{url}/v1/models``."""
    url: str | None = None
    """HTTP base URL, for discovery."""
    endpoint: str | None = None
    """Explicit PUB endpoint to connect to (skips discovery)."""
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class BindSpec:
    """One SUB this process binds; ``sources`` maps each topic to its source."""

    endpoint: str
    sources: Mapping[str, EventSource]


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """Single-ingester coordination through Redis."""

    client: aioredis.Redis
    key_prefix: str = "kvroute"
    ttl_s: float = 10.0
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:"
                        f"{uuid.uuid4().hex[:8]}")  # fmt: skip
    status_interval_s: float = 1.0


class KVEventIngestion:
    """Runs the subscribers for a set of replicas against one index."""

    def __init__(
        self,
        index: KVIndex,
        specs: Sequence[SourceSpec] = (),
        *,
        binds: Sequence[BindSpec] = (),
        http: aiohttp.ClientSession | None = None,
        settings: SubscriberSettings | None = None,
        observer: IngestObserver | None = None,
        lease: LeaseSettings | None = None,
        discovery_timeout_s: float = 2.0,
        discovery_retry_cap_s: float = 30.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._index = index
        self._specs = list(specs)
        self._binds = list(binds)
        self._http = http
        self._s = settings or SubscriberSettings()
        self._obs = observer
        self._lease = lease
        self._discovery_timeout = discovery_timeout_s
        self._backoff = Backoff(1.0, discovery_retry_cap_s, rng=random.Random())
        self._ctx = context
        self._sup = Supervisor(
            Backoff(self._s.backoff_base_s, self._s.backoff_cap_s, rng=random.Random()),
            healthy_after_s=self._s.restart_healthy_after_s,
        )
        self._local: dict[ReplicaId, SourceStatus] = {}
        self._remote: dict[ReplicaId, SourceStatus] = {}
        self._owned: set[ReplicaId] = set()
        self.sources: dict[ReplicaId, EventSource] = {}
        """Every source known so far (configured or discovered)."""

    # ------------------------------------------------------------------ reading

    def statuses(self) -> dict[ReplicaId, SourceStatus]:
        """Snapshots of every source: ingested here, or published by its lease holder."""
        out = dict(self._remote)
        out.update((rid, st) for rid, st in self._local.items() if self._local_wins(rid))
        return out

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """One source's snapshot, if known: ``statuses().get(replica)`` without building
        every source's (the kv policy reads each candidate's on every request)."""
        local = self._local.get(replica)
        if local is not None and self._local_wins(replica):
            return local
        return self._remote.get(replica)

    def _local_wins(self, replica: ReplicaId) -> bool:
        """This process's snapshot of a source it holds is the one to show: it owns the
        source, there is no lease, or the lease holder published none."""
        return replica in self._owned or self._lease is None or replica not in self._remote

    def health(self) -> SupervisorHealth:
        """Sources whose subscriber failed recently (restarted with backoff), and how
        often each was restarted."""
        return self._sup.health()

    def _on_status(self, status: SourceStatus) -> None:
        if self._lease is not None and status.replica in self._owned:
            status = status.with_changes(owner=self._lease.owner)
        self._local[status.replica] = status

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Ingest until cancelled (then every socket is closed)."""
        own_ctx = self._ctx is None
        ctx = self._ctx if self._ctx is not None else zmq.asyncio.Context()
        own_http = self._http is None and any(
            s.endpoint is None or s.model is None for s in self._specs
        )
        http = self._http
        if own_http:
            http = aiohttp.ClientSession()
        children: list[Child] = [
            (f"kv:{spec.replica}", functools.partial(self._run_spec, spec, ctx, http))
            for spec in self._specs
        ]
        children += [(f"kv-bind:{bind.endpoint}", functools.partial(self._run_bind, bind, ctx))
                     for bind in self._binds]  # fmt: skip
        if self._lease is not None:
            children.append(("kv-status", self._publish_statuses))
        try:
            await self._sup.run(children)
        finally:
            if own_http and http is not None:
                await http.close()
            if own_ctx:
                ctx.destroy(linger=0)

    async def _run_spec(
        self, spec: SourceSpec, ctx: zmq.asyncio.Context, http: aiohttp.ClientSession | None
    ) -> None:
        if spec.endpoint is not None:
            model = spec.model
            if model is None:
                if spec.url is None or http is None:
                    raise ValueError(f"{spec.replica}: an explicit endpoint needs a model or url")
                model = await self._discover_model(spec, http)
            src = EventSource(spec.replica, model, spec.endpoint, spec.replay_endpoint,
                              spec.topic)  # fmt: skip
            await self._run_connect(src, ctx)
            return
        if spec.url is None or http is None:
            raise ValueError(f"{spec.replica}: needs an endpoint or a url")
        discovered = await self._discover(spec, http)
        children: list[Child] = []
        for d in discovered:
            if d.mode == "connect":
                run = functools.partial(self._run_connect, d.source, ctx)
            else:
                assert d.bind_endpoint is not None
                bind = BindSpec(d.bind_endpoint, {d.source.topic: d.source})
                run = functools.partial(self._run_bind, bind, ctx)
            children.append((f"kv-source:{d.source.replica}", run))
        await self._sup.run(children)

    async def _discover_model(self, spec: SourceSpec, http: aiohttp.ClientSession) -> str:
        assert spec.url is not None
        failures = 0
        while True:
            try:
                return await discover_model(http, spec.url, timeout_s=self._discovery_timeout)
            except DiscoveryError as exc:
                failures += 1
                delay = self._backoff.compute(failures)
                log.info("%s: model discovery failed (%s); retrying in %.1f s", spec.replica,
                         exc, delay)  # fmt: skip
                await asyncio.sleep(delay)

    async def _discover(self, spec: SourceSpec, http: aiohttp.ClientSession) -> list[Any]:
        assert spec.url is not None
        failures = 0
        while True:
            try:
                model = spec.model or await discover_model(
                    http, spec.url, timeout_s=self._discovery_timeout
                )
                found = await discover_sources(
                    http, spec.url, spec.replica, model, timeout_s=self._discovery_timeout
                )
                for d in found:
                    self.sources[d.source.replica] = d.source
                    self._local.setdefault(
                        d.source.replica,
                        SourceStatus(d.source.replica, model, d.source.endpoint),
                    )
                if not found:
                    log.warning("%s: KV events are not enabled", spec.replica)
                return found
            except DiscoveryError as exc:
                failures += 1
                delay = self._backoff.compute(failures)
                if exc.unsupported:
                    delay = max(delay, 30.0)
                log.info("%s: discovery failed (%s); retrying in %.1f s", spec.replica, exc,
                         delay)  # fmt: skip
                await asyncio.sleep(delay)

    async def _run_connect(self, src: EventSource, ctx: zmq.asyncio.Context) -> None:
        self.sources[src.replica] = src

        def make() -> Coroutine[Any, Any, None]:
            sub = ConnectSubscriber(src, self._index, ctx, settings=self._s,
                                    observer=self._obs, on_status=self._on_status)  # fmt: skip
            return sub.run()

        await self._leased(f"src:{src.replica}", [src], make)

    async def _run_bind(self, bind: BindSpec, ctx: zmq.asyncio.Context) -> None:
        for src in bind.sources.values():
            self.sources[src.replica] = src

        def make() -> Coroutine[Any, Any, None]:
            sub = BindSubscriber(bind.endpoint, bind.sources, self._index, ctx,
                                 settings=self._s, observer=self._obs,
                                 on_status=self._on_status)  # fmt: skip
            return sub.run()

        await self._leased(f"bind:{bind.endpoint}", list(bind.sources.values()), make)

    async def _leased(
        self,
        name: str,
        sources: Sequence[EventSource],
        make: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        if self._lease is None:
            await make()
            return
        ls = self._lease
        lease = RedisLease(ls.client, f"{ls.key_prefix.rstrip(':')}:lease:{name}", ls.owner,
                           ttl_s=ls.ttl_s)  # fmt: skip
        ids = [s.replica for s in sources]

        async def work() -> None:
            self._owned.update(ids)
            try:
                await make()
            finally:
                self._owned.difference_update(ids)

        def standby() -> None:
            for s in sources:
                cur = self._local.get(s.replica)
                if cur is None or cur.state != "standby":
                    self._local[s.replica] = SourceStatus(s.replica, s.model, s.endpoint,
                                                          state="standby")  # fmt: skip

        await run_with_lease(lease, work, on_standby=standby)

    async def _publish_statuses(self) -> None:
        ls = self._lease
        assert ls is not None
        ns = ls.key_prefix.rstrip(":")
        ttl_ms = int(max(ls.ttl_s * 3, ls.status_interval_s * 3) * 1000)
        while True:
            reraise_if_cancelling()  # a client library may have eaten our cancellation
            await asyncio.sleep(ls.status_interval_s)
            try:
                async with asyncio.timeout(max(1.0, ls.status_interval_s)):
                    async with ls.client.pipeline(transaction=False) as pipe:
                        for rid in list(self._owned):
                            st = self._local.get(rid)
                            if st is not None:
                                pipe.set(f"{ns}:status:{rid}", status_to_json(st), px=ttl_ms)
                        others = [r for r in self.sources if r not in self._owned]
                        for rid in others:
                            pipe.get(f"{ns}:status:{rid}")
                        results = await pipe.execute()
                remote: dict[ReplicaId, SourceStatus] = {}
                for rid, raw in zip(others, results[len(results) - len(others) :], strict=True):
                    if isinstance(raw, bytes | str):
                        try:
                            remote[rid] = status_from_json(raw)
                        except (ValueError, KeyError, TypeError):
                            continue
                self._remote = remote
            except (TimeoutError, RedisError, OSError) as exc:
                reraise_if_cancelling()
                log.debug("status publication failed: %s", exc)
