"""KV event ingestion that follows the fleet: one ``KVEventIngestion`` per member replica.

``MemberIngestion.add(spec)`` starts ingesting a replica (its configured endpoint, or its
streams discovered at ``GET /kv_event_sources``, one source per data-parallel rank) as a
task of the app's ``TaskOwner``; ``remove(replica)`` cancels that task (its subscribers
close their sockets and, with a Redis index, release their leases, so the ingestion lease
follows replicas that join and leave) and then clears the replica's entries (every rank)
from the index.  All runs share one ZMQ context, destroyed by ``aclose``.

It answers what the router reads of ingestion (``statuses``, ``status``, ``sources``)
as the union over the runs, so it stands in for a single ``KVEventIngestion``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import zmq.asyncio

from aio.supervisor import SupervisorHealth
from aio.task_owner import TaskOwner
from index.ingestion import KVEventIngestion, LeaseSettings, SourceSpec
from index.status import SourceStatus
from index.store import IndexUnavailable, KVIndex
from index.subscriber import EventSource, IngestObserver
from kvkeys.types import ReplicaId

__all__ = ["MemberIngestion"]

_log = logging.getLogger(__name__)


class MemberIngestion:
    """Per-replica ingestion runs over one index."""

    def __init__(
        self,
        index: KVIndex,
        *,
        tasks: TaskOwner,
        http: aiohttp.ClientSession | None,
        lease: LeaseSettings | None = None,
        observer: IngestObserver | None = None,
    ) -> None:
        self._index = index
        self._tasks = tasks
        self._http = http
        self._lease = lease
        self._observer = observer
        self._ctx = zmq.asyncio.Context()
        self._runs: dict[ReplicaId, tuple[KVEventIngestion, asyncio.Task[Any]]] = {}
        self._leaving: dict[ReplicaId, asyncio.Task[None]] = {}
        self.closed = False

    def add(self, spec: SourceSpec) -> None:
        """Start ingesting ``spec.replica`` (no-op if it is already ingested; after its
        removal has finished if it is being removed)."""
        if self.closed or spec.replica in self._runs:
            return
        leaving = self._leaving.get(spec.replica)
        if leaving is not None:  # back before its entries were cleared: clear, then add

            async def after() -> None:
                await asyncio.gather(leaving, return_exceptions=True)
                self.add(spec)

            self._tasks.spawn(after(), name=f"kv-rejoin:{spec.replica}")
            return
        ing = KVEventIngestion(self._index, [spec], http=self._http, lease=self._lease,
                               observer=self._observer, context=self._ctx)  # fmt: skip
        task = self._tasks.supervise(ing.run, name=f"kv-events:{spec.replica}")
        self._runs[spec.replica] = (ing, task)

    def __contains__(self, replica: object) -> bool:
        return replica in self._runs

    def remove(self, replica: ReplicaId, *, then: Callable[[], object] | None = None
               ) -> asyncio.Task[None]:  # fmt: skip
        """Stop ingesting ``replica`` now, then (in the returned owned task) clear its
        entries (every rank) from the index and call ``then``."""
        run = self._runs.pop(replica, None)
        task: asyncio.Task[None] = self._tasks.spawn(self._finish(replica, run, then),
                                                     name=f"kv-leave:{replica}")
        self._leaving[replica] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._leaving.get(replica) is t:
                del self._leaving[replica]

        task.add_done_callback(done)
        return task

    async def _finish(self, replica: ReplicaId,
                      run: tuple[KVEventIngestion, asyncio.Task[Any]] | None,
                      then: Callable[[], object] | None) -> None:  # fmt: skip
        ids = {replica}
        if run is not None:
            ing, task = run
            ids.update(ing.sources)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for rid in sorted(ids):
            try:
                await self._index.clear(rid)
            except IndexUnavailable as exc:
                # A shared index resynchronises the replica if it ever comes back (its
                # new ingester clears on start); nothing reads these entries meanwhile.
                _log.warning("clearing the entries of %s failed: %s", rid, exc)
        if then is not None:
            then()

    def statuses(self) -> dict[ReplicaId, SourceStatus]:
        """Every source's snapshot, over all runs."""
        out: dict[ReplicaId, SourceStatus] = {}
        for ing, _ in self._runs.values():
            out.update(ing.statuses())
        return out

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """One source's snapshot, if known."""
        run = self._runs.get(replica)
        if run is not None:
            found = run[0].status(replica)
            if found is not None:
                return found
        return self.statuses().get(replica)

    def health(self) -> SupervisorHealth:
        """Sources whose subscriber failed recently, and their restart counts, over all
        runs."""
        failing: dict[str, str] = {}
        restarts: dict[str, int] = {}
        for ing, _ in self._runs.values():
            h = ing.health()
            failing.update(h.failing)
            restarts.update(h.restarts)
        return SupervisorHealth(failing=failing, restarts=restarts)

    @property
    def sources(self) -> dict[ReplicaId, EventSource]:
        """Every source known so far, over all runs."""
        out: dict[ReplicaId, EventSource] = {}
        for ing, _ in self._runs.values():
            out.update(ing.sources)
        return out

    async def aclose(self) -> None:
        """Stop every run, then destroy the shared ZMQ context."""
        self.closed = True
        runs = list(self._runs.values())
        self._runs.clear()
        for _, task in runs:
            task.cancel()
        await asyncio.gather(*(t for _, t in runs), return_exceptions=True)
        self._ctx.destroy(linger=0)
