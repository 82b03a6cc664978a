"""Run-time replica sources for ``router.membership``: a file and DNS names.

* ``FileSource``: a YAML file holding a ``replicas:`` list (the shape of the setting; a
  bare list is accepted too).  Re-read when ``reload()`` is called (the app calls it on
  SIGHUP) and when its modification time or size changes (checked every ``poll_s``).  A
  file that cannot be read or does not validate is logged and changes nothing: the fleet
  keeps the last good list.
* ``DnsSource``: every address each name resolves to is a replica
  ``scheme://address:port`` (the Kubernetes headless-Service pattern), re-resolved every
  ``interval_s``.  The resolver is injected (``system_resolver`` by default: the loop's
  ``getaddrinfo``, off the event loop).  A failed, timed-out or empty answer keeps that
  name's last addresses, so a DNS hiccup never empties the fleet (health checks take
  replicas that really went away out of rotation, the next good answer removes them).

Both run as tasks owned by the app (``run()`` loops until cancelled) and report through
``Membership.set_source``, which diffs against their previous claims.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from aio.task_owner import TaskOwner
from kvkeys.types import ReplicaId
from router.config import DnsSourceSettings, ReplicaSettings, RouterSettings
from router.health import HealthProber
from router.load import LoadTracker
from router.membership import Change, Membership, MembershipMetrics
from router.metrics import RouterMetrics
from router.replica_registry import ReplicaRegistry
from router.series import forget_replica

__all__ = ["DnsSource", "FileSource", "Resolver", "run_membership", "system_resolver"]

_log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(name, port) -> addresses`` (IPv4 or IPv6 literals)."""

_REPLICA_LIST = TypeAdapter(list[ReplicaSettings])


class FileSource:
    """Replicas listed in a YAML file."""

    def __init__(self, path: str | Path, membership: Membership, *, poll_s: float) -> None:
        self.path = Path(path)
        self._membership = membership
        self._poll_s = poll_s
        self._stamp: tuple[int, int] | None = None
        self._wake = asyncio.Event()
        self.reloads = 0
        """Successful reads (each applied, changed or not)."""

    def request_reload(self) -> None:
        """Re-read on the next turn of ``run()`` (safe from a signal handler)."""
        self._wake.set()

    async def reload(self) -> Change | None:
        """Read the file and apply it; ``None`` if it could not be read or validated."""
        try:
            stamp, replicas = await asyncio.to_thread(self._read)
        except (OSError, ValueError) as exc:
            _log.error("membership file %s not applied: %s", self.path, exc)
            return None
        self._stamp = stamp
        change = self._membership.set_source("file", replicas)
        self.reloads += 1
        for why in change.refused:
            _log.warning("membership file %s: %s", self.path, why)
        if change.added or change.removed:
            _log.info("membership file %s: +%s -%s", self.path, list(change.added),
                      list(change.removed))
        return change

    async def run(self, *, initial: bool = True) -> None:
        """Apply the file (now, if ``initial``), then on every request or change, until
        cancelled."""
        if initial:
            await self.reload()
        while True:
            try:
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            except TimeoutError:
                if await asyncio.to_thread(self._current_stamp) == self._stamp:
                    continue
            self._wake.clear()
            await self.reload()

    def _current_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _read(self) -> tuple[tuple[int, int] | None, list[ReplicaSettings]]:
        stamp = self._current_stamp()
        try:
            data: Any = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ValueError(f"invalid YAML: {exc}") from exc
        if isinstance(data, dict):
            data = data.get("replicas", [])
        if data is None:
            data = []
        try:
            replicas = _REPLICA_LIST.validate_python(data)
        except ValidationError as exc:
            raise ValueError(str(exc)) from exc
        ids = [r.id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate replica ids")
        return stamp, replicas


async def system_resolver(name: str, port: int) -> list[str]:
    """The addresses ``name`` resolves to (the system resolver, in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return sorted({str(info[4][0]) for info in infos})


class DnsSource:
    """Replicas behind DNS names, re-resolved on each name's interval."""

    def __init__(
        self,
        names: Sequence[DnsSourceSettings],
        membership: Membership,
        *,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._names = list(names)
        self._membership = membership
        self._resolver = resolver
        self._known: dict[int, list[ReplicaSettings]] = {}
        self.resolutions = 0
        """Resolution rounds that answered (tests wait on it)."""

    async def resolve_once(self, i: int) -> Change | None:
        """Resolve name ``i``; apply the union of every name's replicas if it answered."""
        spec = self._names[i]
        try:
            async with asyncio.timeout(spec.timeout_s):
                addresses = await self._resolver(spec.name, spec.port)
        except (TimeoutError, OSError) as exc:
            _log.warning("membership dns %s: resolution failed (%s); keeping %d replicas",
                         spec.name, exc, len(self._known.get(i, [])))
            return None
        if not addresses:
            _log.warning("membership dns %s: no address; keeping the last ones", spec.name)
            return None
        self._known[i] = [ReplicaSettings(url=_url(spec, a)) for a in addresses]
        self.resolutions += 1
        union: dict[str, ReplicaSettings] = {}
        for replicas in self._known.values():
            for r in replicas:
                union.setdefault(r.id, r)
        change = self._membership.set_source("dns", list(union.values()))
        if change.added or change.removed:
            _log.info("membership dns %s: +%s -%s", spec.name, list(change.added),
                      list(change.removed))
        return change

    async def run(self, *, initial: bool = True) -> None:
        """Resolve every name on its interval (first at once, if ``initial``) until
        cancelled."""
        async with asyncio.TaskGroup() as tg:
            for i in range(len(self._names)):
                tg.create_task(self._loop(i, initial), name=f"dns:{self._names[i].name}")

    async def _loop(self, i: int, initial: bool) -> None:
        if not initial:
            await asyncio.sleep(self._names[i].interval_s)
        while True:
            await self.resolve_once(i)
            await asyncio.sleep(self._names[i].interval_s)


def _url(spec: DnsSourceSettings, address: str) -> str:
    host = address
    try:
        if ipaddress.ip_address(address).version == 6:
            host = f"[{address}]"
    except ValueError:
        pass
    return f"{spec.scheme}://{host}:{spec.port}"


@asynccontextmanager
async def run_membership(
    settings: RouterSettings,
    replicas: ReplicaRegistry,
    load: LoadTracker,
    *,
    metrics: RouterMetrics,
    prober: HealthProber,
    tasks: TaskOwner,
    resolver: Resolver | None = None,
    sighup: bool = True,
) -> AsyncIterator[Membership]:
    """Build the ``Membership``, apply the file and DNS sources once (awaited, so the
    first requests see them), then keep them current as owned tasks; SIGHUP re-reads
    the file (when ``sighup`` and the loop allows signal handlers)."""
    m = settings.membership
    series = MembershipMetrics(metrics.registry, replicas)

    def forget(replica: ReplicaId) -> None:
        load.forget(replica)
        prober.forget(replica)
        forget_replica([metrics, metrics.kv], replica)

    membership = Membership(replicas, load, tasks=tasks, metrics=series, probe=prober.probe,
                            drain_timeout_s=m.drain_timeout_s, forget=forget)
    loop = asyncio.get_running_loop()
    hup = False
    try:
        if m.file is not None:
            file_source = FileSource(m.file, membership, poll_s=m.file_poll_s)
            await file_source.reload()
            tasks.spawn(file_source.run(initial=False), name="membership-file")
            if sighup:
                try:
                    loop.add_signal_handler(signal.SIGHUP, file_source.request_reload)
                    hup = True
                except (NotImplementedError, RuntimeError, ValueError) as exc:
                    _log.warning("no SIGHUP reload in this process: %s", exc)
        if m.dns:
            dns = DnsSource(m.dns, membership, resolver=resolver or system_resolver)
            for i in range(len(m.dns)):
                await dns.resolve_once(i)
            tasks.spawn(dns.run(initial=False), name="membership-dns")
        yield membership
    finally:
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        series.close()
