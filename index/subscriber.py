"""ZMQ subscription to vLLM KV events, with sequence tracking and replay.

Two deployments, as vLLM supports them:

* **connect** (``ConnectSubscriber``): the engine binds its PUB (``tcp://*:5557``); we
  connect one SUB per event source (a replica, or one DP rank of it) to
  ``tcp://<replica host>:<port>``.
* **bind** (``BindSubscriber``): we bind one SUB; engines configured with
  ``endpoint=tcp://<router host>:<port>`` connect to it.  Each message's topic names its
  source through a configured mapping (llm-d's ``kv@<pod>@<model>`` convention works);
  messages with an unmapped topic are counted and dropped.

Per source, ``index.source_runner.SourceRunner`` keeps the sequence state and applies
the batches (gaps, replay, restarts, invalid events, index outages and resets,
disconnections: the rules are in its module).

Every socket operation has a timeout; sockets are reopened with a backoff after errors;
every task belongs to the subscriber's ``run()`` and ends with it (``run`` is cancelled
by its owner, sockets are closed in ``finally``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aio.backoff import Backoff
from aio.cancel import reraise_if_cancelling
from index.replay import ReplayFailed, fetch_replay
from index.source_runner import EventSource, IngestObserver, SourceRunner, SubscriberSettings
from index.status import SourceStatus
from index.store import KVIndex
from kvkeys.types import ReplicaId

__all__ = [
    "BindSubscriber",
    "ConnectSubscriber",
    "EventSource",
    "IngestObserver",
    "ReplayFailed",
    "SourceRunner",
    "SubscriberSettings",
    "fetch_replay",
]

log = logging.getLogger(__name__)


class _Monitor:
    """Tracks a socket's peers through ZMQ's socket monitor."""

    def __init__(self, on_change: Callable[[bool], None]) -> None:
        self._on_change = on_change
        self._peers = 0

    def attach(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """Start monitoring ``sock`` (before it connects or binds, so no event is missed)."""
        mon: zmq.asyncio.Socket = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        return mon

    async def run(self, sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket) -> None:
        """Follow the monitor's events until cancelled."""
        try:
            while True:
                frames = await mon.recv_multipart()
                event = parse_monitor_message(frames)["event"]
                if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                    self._peers += 1
                elif event == zmq.EVENT_DISCONNECTED:
                    self._peers = max(0, self._peers - 1)
                self._on_change(self._peers > 0)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(linger=0)


def _frames_to_message(frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


class ConnectSubscriber:
    """Connects a SUB to one engine's bound PUB and feeds one ``SourceRunner``."""

    def __init__(
        self,
        source: EventSource,
        index: KVIndex,
        ctx: zmq.asyncio.Context,
        *,
        settings: SubscriberSettings | None = None,
        observer: IngestObserver | None = None,
        on_status: Callable[[SourceStatus], None] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        if source.endpoint is None:
            raise ValueError(f"{source.replica}: connect mode needs an endpoint")
        self._s = settings or SubscriberSettings()
        self._ctx = ctx
        self._obs = observer
        self.runner = SourceRunner(
            source, index, ctx, settings=self._s, observer=observer, on_status=on_status
        )
        self._backoff = backoff or Backoff(self._s.backoff_base_s, self._s.backoff_cap_s,
                                           rng=random.Random())

    @property
    def status(self) -> SourceStatus:
        """The source's current snapshot."""
        return self.runner.status

    async def run(self) -> None:
        """Subscribe until cancelled, reopening the socket with backoff after errors."""
        failures = 0
        started = False
        try:
            while True:
                try:
                    await self._session(first=not started)
                    started = True
                except (zmq.ZMQError, OSError) as exc:
                    reraise_if_cancelling()
                    failures += 1
                    log.warning("%s: subscriber error: %s", self.runner.source.replica, exc)
                    self.runner.set_state("degraded", str(exc))
                    await asyncio.sleep(self._backoff.compute(failures))
        finally:
            self.runner.set_connected(False)
            self.runner.set_state("stopped")

    async def _session(self, *, first: bool) -> None:
        src = self.runner.source
        assert src.endpoint is not None
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._s.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
            monitor = _Monitor(self.runner.set_connected)
            async with asyncio.TaskGroup() as tg:
                mon = monitor.attach(sub)
                mon_task = tg.create_task(monitor.run(sub, mon), name=f"kv-monitor-{src.replica}")
                sub.connect(src.endpoint)
                try:
                    if first:
                        await self.runner.start()
                    poll_ms = int(self._s.idle_poll_s * 1000)
                    while True:
                        reraise_if_cancelling()
                        if not await sub.poll(poll_ms):
                            await self.runner.tick()
                            continue
                        msg = _frames_to_message(await sub.recv_multipart())
                        if msg is None:
                            if self._obs is not None:
                                self._obs.dropped(src.replica, "malformed_frames")
                            continue
                        await self.runner.on_live(msg[1], msg[2])
                finally:
                    mon_task.cancel()
        finally:
            sub.close(linger=0)
            self.runner.set_connected(False)  # the monitor may not report it any more


class BindSubscriber:
    """Binds one SUB that engines connect to; routes messages to sources by topic."""

    def __init__(
        self,
        endpoint: str,
        sources: Mapping[str, EventSource],
        index: KVIndex,
        ctx: zmq.asyncio.Context,
        *,
        settings: SubscriberSettings | None = None,
        observer: IngestObserver | None = None,
        on_status: Callable[[SourceStatus], None] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._endpoint = endpoint
        self.bound_endpoint: str | None = None
        """The bound address once running (a ``:0`` port resolved)."""
        self._s = settings or SubscriberSettings()
        self._ctx = ctx
        self._obs = observer
        self._index = index
        self._on_status = on_status
        self.runners: dict[bytes, SourceRunner] = {}
        self._pending: list[SourceRunner] = []
        self._has_peers = False
        for topic, src in sources.items():
            self.add_source(topic, src)
        self.unmapped = 0
        """Messages whose topic maps to no source."""
        self._backoff = backoff or Backoff(self._s.backoff_base_s, self._s.backoff_cap_s,
                                           rng=random.Random())
        self.ready = asyncio.Event()
        """Set once the SUB socket is bound."""

    def add_source(self, topic: str, source: EventSource) -> None:
        """Map ``topic`` to ``source`` (also while running: it starts on the next message
        or idle tick, with the usual clear + replay from 0)."""
        runner = SourceRunner(
            source, self._index, self._ctx, settings=self._s, observer=self._obs,
            on_status=self._on_status,
        )  # fmt: skip
        runner.set_connected(self._has_peers)
        self.runners[topic.encode()] = runner
        self._pending.append(runner)

    def statuses(self) -> dict[ReplicaId, SourceStatus]:
        """Snapshots of every mapped source."""
        return {r.source.replica: r.status for r in self.runners.values()}

    def _connected(self, value: bool) -> None:
        self._has_peers = value
        for r in self.runners.values():
            r.set_connected(value)

    async def run(self) -> None:
        """Receive until cancelled, rebinding with backoff after errors."""
        failures = 0
        try:
            while True:
                try:
                    await self._session()
                except (zmq.ZMQError, OSError) as exc:
                    reraise_if_cancelling()
                    failures += 1
                    log.warning("bound subscriber %s error: %s", self._endpoint, exc)
                    await asyncio.sleep(self._backoff.compute(failures))
        finally:
            for r in self.runners.values():
                r.set_connected(False)
                r.set_state("stopped")

    async def _session(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._s.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = _Monitor(self._connected)
            async with asyncio.TaskGroup() as tg:
                mon = monitor.attach(sub)
                mon_task = tg.create_task(monitor.run(sub, mon), name="kv-monitor-bound")
                sub.bind(self._endpoint)
                last = sub.getsockopt(zmq.LAST_ENDPOINT)
                self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
                self.ready.set()
                try:
                    poll_ms = int(self._s.idle_poll_s * 1000)
                    while True:
                        reraise_if_cancelling()
                        while self._pending:
                            await self._pending.pop(0).start()
                        if not await sub.poll(poll_ms):
                            for r in self.runners.values():
                                await r.tick()
                            continue
                        msg = _frames_to_message(await sub.recv_multipart())
                        if msg is None:
                            self.unmapped += 1
                            continue
                        runner = self.runners.get(msg[0])
                        if runner is None:
                            self.unmapped += 1
                            continue
                        await runner.on_live(msg[1], msg[2])
                finally:
                    mon_task.cancel()
        finally:
            self.ready.clear()
            sub.close(linger=0)
            self._connected(False)
