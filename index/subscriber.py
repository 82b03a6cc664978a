"""ZMQ subscription to vLLM KV events, with sequence tracking and replay.

Two deployments, as vLLM supports them:

* **connect** (``ConnectSubscriber``): the engine binds its PUB (``tcp://*:5557``); we
  connect one SUB per event source (a replica, or one DP rank of it) to
  ``tcp://<replica host>:<port>``.
* **bind** (``BindSubscriber``): we bind one SUB; engines configured with
  ``endpoint=tcp://<router host>:<port>`` connect to it.  Each message's topic names its
  source through a configured mapping (llm-d's ``kv@<pod>@<model>`` convention works);
  messages with an unmapped topic are counted and dropped.

Per source, ``SourceRunner`` keeps the sequence state (vLLM's rules, section 1.2-1.3 of
the interface notes):

* On start (and on lease takeover) the replica's entries are cleared and the replay
  socket asked for everything from 0.
* A live ``seq`` more than one past the last applied is a **gap**: replay from
  ``last + 1`` over a DEALER (``[b"", seq8]``; replies ``[b"", topic, seq8, payload]``
  (0.28+) or ``[b"", seq8, payload]``, ending with an empty last frame).  If the first
  replayed seq is later than asked, history was lost: clear and rebuild from what is
  retained.  If replay fails or there is no replay endpoint: clear and let the replica
  repopulate.
* A live ``seq`` at or below the last *live* one means the engine restarted (vLLM starts
  from 0 and sends no ``AllBlocksCleared``): clear, then replay from 0.  Live messages
  already applied through replay are ignored.
* An undecodable payload is counted and skipped (its seq still counts).
* If the index cannot be written (``IndexUnavailable``), the source turns ``degraded``,
  later batches are dropped, and once the index answers again the replica is cleared
  and rebuilt from replay: nothing stale survives an outage.
* Repeated unknown parents (``index.event_applier``) trigger the same rebuild, at most once per
  ``resync_min_interval_s``.
* A source whose transport stays down for ``disconnect_grace_s`` (a dead engine) is
  cleared from the index, counted as a resync (reason ``disconnected``), turns
  ``disconnected``, and its sequence is forgotten; when it connects again it is rebuilt
  (clear + replay from 0, reason ``reconnect``), as a restarted engine counts from 0.
  A shorter blip changes nothing: live messages resume from ``last + 1`` (gap and restart
  rules as above).  Only the process running the subscriber (the lease holder, with a
  shared index) clears.  Connect mode follows each engine's connection through the socket
  monitor.  Bind mode only sees the bound SUB's peers as a whole: its sources are cleared
  when *no* engine has been connected for the grace period; one dead engine among others
  still connected is not detected (its entries go only when it restarts and publishes).

Every socket operation has a timeout; sockets are reopened with a backoff after errors;
every task belongs to the subscriber's ``run()`` and ends with it (``run`` is cancelled
by its owner, sockets are closed in ``finally``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aio.backoff import Backoff
from aio.cancel import reraise_if_cancelling
from index.event_applier import DEFAULT_PARENT_CACHE, BatchResult, EventIngestor
from index.events import UndecodableBatch, decode_batch
from index.status import SourceState, SourceStatus
from index.store import IndexUnavailable, KVIndex
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

END_SEQ: Final = b"\xff" * 8


@dataclass(frozen=True, slots=True)
class EventSource:
    """One KV event stream: a replica (or one DP rank of it) and where to reach it."""

    replica: ReplicaId
    """Event-source id (``replica_id_for_rank`` for DP ranks above 0)."""
    model: str
    """The base model the replica serves (the root of its request keys)."""
    endpoint: str | None
    """The engine's PUB address to connect to (connect mode), else ``None``."""
    replay_endpoint: str | None = None
    topic: str = ""
    """Subscription prefix (connect mode) or the exact topic (bind mode)."""


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    """Timeouts and limits of the subscribers."""

    idle_poll_s: float = 0.5
    """Longest wait for a live message before housekeeping (status, recovery)."""
    replay_timeout_s: float = 2.0
    """Longest wait for each replay message, the first one included."""
    replay_total_s: float = 30.0
    """Longest whole replay."""
    resync_min_interval_s: float = 10.0
    """Rebuilds requested by unknown parents happen at most this often."""
    recover_interval_s: float = 1.0
    """How often a degraded source retries clearing the index."""
    disconnect_grace_s: float = 2.0
    """How long a source's connection may stay lost before its entries are cleared."""
    resync_after_unknown_parents: int = 3
    parent_cache_blocks: int = DEFAULT_PARENT_CACHE
    """Engine keys each source's ingestor remembers to resolve parents without asking
    the index (``index.event_applier``); 0 asks the index for every batch's parents."""
    rcvhwm: int = 100_000
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 5.0


class IngestObserver(Protocol):
    """Receives what happens to each source (metrics live outside ``index``)."""

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        """One batch was applied."""

    def gap(self, replica: ReplicaId) -> None:
        """A sequence gap was detected."""

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        """Batches were not applied (``undecodable``, ``index_unavailable``, ...)."""

    def resync(self, replica: ReplicaId, reason: str) -> None:
        """The replica's entries were cleared for a rebuild."""


class ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered garbage."""


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    *,
    timeout_s: float,
    total_s: float,
) -> list[tuple[int, bytes]]:
    """Ask a vLLM replay ROUTER for every retained batch with ``seq >= start``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(endpoint)
        async with asyncio.timeout(total_s):
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(timeout_s * 1000)):
                    raise ReplayFailed(f"replay from {endpoint} timed out")
                frames = await sock.recv_multipart()
                if len(frames) < 3 or frames[0] != b"":
                    raise ReplayFailed(f"bad replay reply ({len(frames)} frames)")
                if frames[-1] == b"":
                    return out
                seq8 = frames[-2]
                if len(seq8) != 8 or len(frames) not in (3, 4):
                    raise ReplayFailed("bad replay sequence frame")
                out.append((int.from_bytes(seq8, "big"), frames[-1]))
    except TimeoutError as exc:
        reraise_if_cancelling()
        raise ReplayFailed(f"replay from {endpoint} exceeded {total_s:g} s") from exc
    except zmq.ZMQError as exc:
        reraise_if_cancelling()
        raise ReplayFailed(f"replay from {endpoint}: {exc}") from exc
    finally:
        sock.close(linger=0)


class SourceRunner:
    """Sequence state and ingestion of one event source (owned by one subscriber)."""

    def __init__(
        self,
        source: EventSource,
        index: KVIndex,
        ctx: zmq.asyncio.Context,
        *,
        settings: SubscriberSettings,
        observer: IngestObserver | None = None,
        on_status: Callable[[SourceStatus], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self._index = index
        self._ctx = ctx
        self._s = settings
        self._obs = observer
        self._on_status = on_status
        self._clock = clock
        self._wall = wall
        self._ingestor = EventIngestor(
            index,
            source.replica,
            source.model,
            resync_after=settings.resync_after_unknown_parents,
            parent_cache=settings.parent_cache_blocks,
        )
        self.last_seq: int | None = None
        self._live_last: int | None = None
        self._dirty = False
        self._resync_reason: str | None = None
        self._last_resync = -1e18
        self._last_recover_try = -1e18
        self._down_since: float | None = clock()
        """When the transport was last seen lost (``None`` while connected)."""
        self._down_cleared = False
        """The entries were cleared for the current outage (rebuild on reconnect)."""
        self._status = SourceStatus(source.replica, source.model, source.endpoint)

    # ------------------------------------------------------------------ status

    @property
    def status(self) -> SourceStatus:
        """The current snapshot."""
        return self._status

    def _set(self, **changes: object) -> None:
        self._status = self._status.with_changes(**changes)
        if self._on_status is not None:
            self._on_status(self._status)

    def set_connected(self, connected: bool) -> None:
        """Record the transport's state (from the socket monitor): a loss starts the
        disconnect grace period; a reconnection after the entries were cleared for it
        schedules a rebuild (clear + replay from 0) for the next message or tick."""
        if connected:
            self._down_since = None
            if self._down_cleared:
                self._down_cleared = False
                self._resync_reason = "reconnect"
        elif self._down_since is None:
            self._down_since = self._clock()
        if connected != self._status.connected:
            self._set(connected=connected)

    def set_state(self, state: SourceState, error: str | None = None) -> None:
        """Record a lifecycle state (``standby``, ``stopped``, ...)."""
        self._set(state=state, last_error=error)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Clear what the index holds for this source and replay from 0."""
        self._live_last = None
        await self._rebuild("start")

    async def tick(self) -> None:
        """Housekeeping while idle: clear a source disconnected for longer than the
        grace period, retry a pending recovery."""
        down = self._down_since
        if (
            down is not None
            and not self._down_cleared
            and self._clock() - down >= self._s.disconnect_grace_s
        ):
            now = self._clock()
            if self._dirty and now - self._last_recover_try < self._s.recover_interval_s:
                return
            self._last_recover_try = now
            await self._disconnected()
            return
        await self._maybe_recover()

    async def on_live(self, seq: int, payload: bytes) -> None:
        """Handle one live message."""
        recv_wall = self._wall()
        if self._live_last is not None and seq <= self._live_last:
            log.info("%s: sequence went back (%d -> %d): engine restart", self.source.replica,
                     self._live_last, seq)  # fmt: skip
            self._live_last = seq
            self._resync_reason = "restart"
            self._last_resync = -1e18  # restarts are never rate-limited
            await self._maybe_recover()
            if self.last_seq is None or seq > self.last_seq:
                await self._apply(seq, payload, recv_wall)
            return
        self._live_last = seq
        await self._maybe_recover()
        if self.last_seq is not None:
            if seq <= self.last_seq:
                return  # already applied through replay
            if seq > self.last_seq + 1:
                self._set(gaps=self._status.gaps + 1)
                if self._obs is not None:
                    self._obs.gap(self.source.replica)
                await self._replay(self.last_seq + 1, seq - 1)
                if self.last_seq is not None and seq <= self.last_seq:
                    return
        await self._apply(seq, payload, recv_wall)

    # ------------------------------------------------------------------ internals

    async def _apply(self, seq: int, payload: bytes, recv_wall: float | None = None) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except UndecodableBatch as exc:
            log.warning("%s: dropping undecodable batch %d: %s", self.source.replica, seq, exc)
            self._set(last_seq=seq, undecodable=self._status.undecodable + 1)
            if self._obs is not None:
                self._obs.dropped(self.source.replica, "undecodable")
            return
        if self._dirty:
            if self._obs is not None:
                self._obs.dropped(self.source.replica, "index_unavailable")
            self._set(last_seq=seq)
            return
        try:
            result = await self._ingestor.apply(batch)
        except IndexUnavailable as exc:
            self._dirty = True
            self._set(state="degraded", last_seq=seq, last_error=str(exc))
            if self._obs is not None:
                self._obs.dropped(self.source.replica, "index_unavailable")
            return
        changes: dict[str, object] = {
            "last_seq": seq,
            "last_event_wall": batch.ts,
            "batches": self._status.batches + 1,
            "block_size": self._ingestor.last_block_size,
        }
        if recv_wall is not None:
            changes["last_receive_wall"] = recv_wall
            changes["receive_lag_s"] = max(0.0, recv_wall - batch.ts)
        if self._status.state in ("starting", "resyncing"):
            changes["state"] = "live"
        self._set(**changes)
        if self._obs is not None:
            self._obs.batch_applied(self.source.replica, result)
        if result.resync_requested and self._resync_reason is None:
            if self._clock() - self._last_resync >= self._s.resync_min_interval_s:
                self._resync_reason = "unknown_parent"

    async def _replay(self, start: int, until: int) -> None:
        """Fill the gap ``start..until``; if the replica no longer has it, or replay fails,
        clear and let the replica repopulate."""
        ep = self.source.replay_endpoint
        if ep is None:
            await self._clear("no_replay")
            return
        try:
            msgs = await fetch_replay(
                self._ctx, ep, start, timeout_s=self._s.replay_timeout_s,
                total_s=self._s.replay_total_s,
            )  # fmt: skip
        except ReplayFailed as exc:
            log.warning("%s: replay failed: %s", self.source.replica, exc)
            self._set(last_error=str(exc))
            await self._clear("replay_failed")
            return
        self._set(replays=self._status.replays + 1)
        if not msgs or msgs[0][0] > start:
            # Batches (maybe removals) we never saw are gone: rebuild from what is left.
            log.info("%s: replay lost history from %d", self.source.replica, start)
            if not await self._clear("history_lost"):
                return
        for seq, payload in msgs:
            if self.last_seq is None or seq > self.last_seq:
                await self._apply(seq, payload)
        if self.last_seq is None or self.last_seq < until:
            self.last_seq = until

    async def _clear(self, reason: str) -> bool:
        try:
            await self._index.clear(self.source.replica)
        except IndexUnavailable as exc:
            self._dirty = True
            self._set(state="degraded", last_error=str(exc))
            return False
        self._ingestor.reset()
        self._dirty = False
        now = self._clock()
        self._last_resync = now
        changes: dict[str, object] = {
            "last_reset_monotonic": now,
            "last_reset_wall": self._wall(),
        }
        if reason != "start":
            changes["resyncs"] = self._status.resyncs + 1
            if self._obs is not None:
                self._obs.resync(self.source.replica, reason)
        self._set(**changes)
        return True

    async def _disconnected(self) -> None:
        """The engine is gone: drop its entries and its sequence (``tick``)."""
        log.info("%s: disconnected for %.1f s or more: clearing its entries",
                 self.source.replica, self._s.disconnect_grace_s)  # fmt: skip
        if not await self._clear("disconnected"):
            return  # degraded: retried every ``recover_interval_s`` by ``tick``
        self._down_cleared = True
        self._resync_reason = None
        self.last_seq = None
        self._live_last = None
        self._set(state="disconnected", last_seq=None)

    async def _rebuild(self, reason: str) -> None:
        self._set(state="resyncing")
        self._resync_reason = None
        if not await self._clear(reason):
            return
        self.last_seq = None
        ep = self.source.replay_endpoint
        if ep is not None:
            try:
                msgs = await fetch_replay(
                    self._ctx, ep, 0, timeout_s=self._s.replay_timeout_s,
                    total_s=self._s.replay_total_s,
                )  # fmt: skip
            except ReplayFailed as exc:
                log.info("%s: no replay on %s: %s", self.source.replica, reason, exc)
                msgs = []
            else:
                self._set(replays=self._status.replays + 1)
            for seq, payload in msgs:
                if self.last_seq is None or seq > self.last_seq:
                    await self._apply(seq, payload)
        if not self._dirty:
            self._set(state="live", last_error=None)

    async def _maybe_recover(self) -> None:
        if self._dirty:
            now = self._clock()
            if now - self._last_recover_try < self._s.recover_interval_s:
                return
            self._last_recover_try = now
            await self._rebuild("index_outage")
        elif self._resync_reason is not None:
            await self._rebuild(self._resync_reason)


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
