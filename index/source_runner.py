"""One KV event source: its sequence state, replay and rebuilds.

``SourceRunner`` keeps, per source, the sequence state (vLLM's rules, section 1.2-1.3 of
the interface notes):

* On start (and on lease takeover) the replica's entries are cleared and the replay
  socket asked for everything from 0.  A replay is applied from its last batch holding
  an ``AllBlocksCleared`` (what came before it is superseded: the clear empties the
  replica in every tier), and it gives the event loop back every ``replay_slice_s``:
  an engine's buffer holds up to 10,000 batches, and applying them in one go held every
  request of the router up for as long (seconds, after a few prefix-cache resets).
* A live ``seq`` more than one past the last applied is a **gap**: replay from
  ``last + 1`` over a DEALER (``[b"", seq8]``; replies ``[b"", topic, seq8, payload]``
  (0.28+) or ``[b"", seq8, payload]``, ending with an empty last frame).  With nothing
  applied since the last clear (the start's replay found nothing, or failed because
  the engine was not up yet), a first live ``seq`` above 0 is a gap from 0 where the
  source has a replay endpoint: the engine's first batches were lost to the PUB
  socket's slow joining.  If the first replayed seq is later than asked, history was
  lost: clear and rebuild from what is retained.  If replay fails or there is no
  replay endpoint: clear and let the replica repopulate.
* A live ``seq`` at or below the last *live* one means the engine restarted (vLLM starts
  from 0 and sends no ``AllBlocksCleared``): clear, then replay from 0.  Live messages
  already applied through replay are ignored.
* An undecodable payload is counted and skipped (its seq still counts).  An invalid
  event (``index.events.InvalidEvent``) is dropped and counted by the ingestor while the
  rest of its batch is applied, with one rate-limited log line per source and field.
  When what was dropped may have been a removal (an undecodable batch, an invalid
  ``BlockRemoved``), blocks the engine dropped could stay indexed: the source is rebuilt
  (clear, then replay from the batch *after* the bad one, so it is not met again; reason
  ``invalid_event`` or ``undecodable``), at most once per ``resync_min_interval_s`` but
  never forgotten.
* If the index cannot be written (``IndexUnavailable``), the source turns ``degraded``,
  later batches are dropped, and once the index answers again the replica is cleared
  and rebuilt from replay: nothing stale survives an outage.  A shared index that lost
  its contents (``IndexReset``: Redis restarted empty or flushed) is the same, with
  reason ``index_reset``; an idle source learns it from ``KVIndex.stale`` on its
  housekeeping tick, so every replica comes back, not only those that write.
* Repeated unknown parents (``index.event_applier``) trigger the same rebuild, at most
  once per ``resync_min_interval_s``.
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

``EventSource`` (where a stream is), ``SubscriberSettings`` (timeouts and limits) and
``IngestObserver`` (what happens, for metrics) are shared with ``index.subscriber``,
which moves the bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq.asyncio

from index.event_applier import DEFAULT_PARENT_CACHE, BatchResult, EventIngestor
from index.events import ClearedEvent, UndecodableBatch, decode_batch
from index.log_limit import RateLimitedLog
from index.replay import ReplayFailed, fetch_replay
from index.status import SourceState, SourceStatus
from index.store import IndexReset, IndexUnavailable, KVIndex
from kvkeys.types import ReplicaId

__all__ = ["EventSource", "IngestObserver", "SourceRunner", "SubscriberSettings"]

log = logging.getLogger(__name__)


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
    replay_slice_s: float = 0.005
    """Longest the event loop is held while applying a replay before it is given back
    (0: after every batch)."""
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
    """Reopening a socket, and restarting a source whose subscriber failed."""
    restart_healthy_after_s: float = 10.0
    """A restarted source counts as failing (``KVEventIngestion.health``) this long, and
    a run this long resets its restart backoff."""
    invalid_log_interval_s: float = 10.0
    """At most one log line per source and invalid field (or undecodable batch) this
    often; every occurrence is counted in metrics."""


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
        self._dirty_reason = "index_outage"
        self._resync_reason: str | None = None
        self._resync_from = 0
        """Where the next rebuild's replay starts (past a batch that must not be met again)."""
        self._bad_log = RateLimitedLog(log, interval_s=settings.invalid_log_interval_s,
                                       clock=clock)  # fmt: skip
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
        if self._resync_reason is None and not self._dirty and self.last_seq is not None:
            try:
                if await self._index.stale(self.source.replica):
                    log.info("%s: the index was reset (restart or flush): rebuilding",
                             self.source.replica)  # fmt: skip
                    self._resync_reason = "index_reset"
            except IndexUnavailable:
                pass  # the next write finds out, and degrades the source
        await self._maybe_recover()

    async def on_live(self, seq: int, payload: bytes) -> None:
        """Handle one live message."""
        recv_wall = self._wall()
        if self._live_last is not None and seq <= self._live_last:
            log.info("%s: sequence went back (%d -> %d): engine restart", self.source.replica,
                     self._live_last, seq)  # fmt: skip
            self._live_last = seq
            self._resync_reason = "restart"
            self._resync_from = 0
            self._last_resync = -1e18  # restarts are never rate-limited
            await self._maybe_recover()
            if self.last_seq is None or seq > self.last_seq:
                await self._apply(seq, payload, recv_wall)
            return
        self._live_last = seq
        await self._maybe_recover()
        if self.last_seq is not None and seq <= self.last_seq:
            return  # already applied through replay
        # With nothing applied since the last clear, the batches before this one are
        # unknown: the engine counts from 0, so a first seq above 0 is a gap from 0
        # (where there is a replay to fill it).
        if self.last_seq is not None:
            expected = self.last_seq + 1
        else:
            expected = 0 if self.source.replay_endpoint is not None else seq
        if seq > expected:
            self._set(gaps=self._status.gaps + 1)
            if self._obs is not None:
                self._obs.gap(self.source.replica)
            await self._replay(expected, seq - 1)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        await self._apply(seq, payload, recv_wall)

    # ------------------------------------------------------------------ internals

    async def _apply(self, seq: int, payload: bytes, recv_wall: float | None = None) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except UndecodableBatch as exc:
            self._bad_log.warning("undecodable", "%s: dropping undecodable batch %d: %s",
                                  self.source.replica, seq, exc)  # fmt: skip
            self._set(last_seq=seq, undecodable=self._status.undecodable + 1)
            if self._obs is not None:
                self._obs.dropped(self.source.replica, "undecodable")
            self._hole(seq, "undecodable")
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
            self._dirty_reason = "index_reset" if isinstance(exc, IndexReset) else "index_outage"
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
        if result.invalid:
            changes["invalid_events"] = self._status.invalid_events + len(result.invalid)
            for bad in result.invalid:
                self._bad_log.warning(
                    f"invalid:{bad.field}", "%s: dropping an invalid %s in batch %d (field %s: "
                    "%s)", self.source.replica, bad.kind, seq, bad.field, bad.detail,
                )  # fmt: skip
        self._set(**changes)
        if result.hole:
            self._hole(seq, "invalid_event")
        if self._obs is not None:
            self._obs.batch_applied(self.source.replica, result)
        if result.resync_requested and self._resync_reason is None:
            if self._clock() - self._last_resync >= self._s.resync_min_interval_s:
                self._resync_reason = "unknown_parent"

    async def _apply_replayed(self, msgs: Sequence[tuple[int, bytes]]) -> None:
        """Apply the replayed batches not applied yet, in order, from the last one
        holding an ``AllBlocksCleared`` (module docstring), giving the event loop back
        every ``replay_slice_s``."""
        todo = [(seq, payload) for seq, payload in msgs
                if self.last_seq is None or seq > self.last_seq]
        first = _last_clearing(todo)
        if first:
            self.last_seq = todo[first - 1][0]
            log.info("%s: replay: %d batches before the last clear skipped",
                     self.source.replica, first)  # fmt: skip
        slice_s = self._s.replay_slice_s
        until = time.perf_counter() + slice_s
        for seq, payload in todo[first:]:
            await self._apply(seq, payload)
            if time.perf_counter() >= until:
                await asyncio.sleep(0)
                until = time.perf_counter() + slice_s

    def _hole(self, seq: int, reason: str) -> None:
        """Batch ``seq`` may have held removals that were not applied: rebuild past it."""
        self._resync_from = max(self._resync_from, seq + 1)
        if self._resync_reason is None:
            self._resync_reason = reason

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
        await self._apply_replayed(msgs)
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
        self._resync_from = 0
        self.last_seq = None
        self._live_last = None
        self._set(state="disconnected", last_seq=None)

    async def _rebuild(self, reason: str) -> None:
        self._set(state="resyncing")
        self._resync_reason = None
        if not await self._clear(reason):
            return
        self.last_seq = None
        start, self._resync_from = self._resync_from, 0
        ep = self.source.replay_endpoint
        if ep is not None:
            try:
                msgs = await fetch_replay(
                    self._ctx, ep, start, timeout_s=self._s.replay_timeout_s,
                    total_s=self._s.replay_total_s,
                )  # fmt: skip
            except ReplayFailed as exc:
                log.info("%s: no replay on %s: %s", self.source.replica, reason, exc)
                msgs = []
            else:
                self._set(replays=self._status.replays + 1)
            await self._apply_replayed(msgs)
        if not self._dirty:
            self._set(state="live", last_error=None)

    async def _maybe_recover(self) -> None:
        if self._dirty:
            now = self._clock()
            if now - self._last_recover_try < self._s.recover_interval_s:
                return
            self._last_recover_try = now
            await self._rebuild(self._dirty_reason)
        elif self._resync_reason is not None:
            if (
                self._resync_reason in ("invalid_event", "undecodable")
                and self._clock() - self._last_resync < self._s.resync_min_interval_s
            ):
                return
            await self._rebuild(self._resync_reason)


_CLEARED_TAG = b"AllBlocksCleared"


def _last_clearing(batches: Sequence[tuple[int, bytes]]) -> int:
    """The position of the last batch holding an ``AllBlocksCleared``, else 0.  The tag's
    bytes pick the candidates; decoding confirms them (an id or hash could hold them)."""
    for i in range(len(batches) - 1, 0, -1):
        payload = batches[i][1]
        if _CLEARED_TAG not in payload:
            continue
        try:
            batch = decode_batch(payload)
        except UndecodableBatch:
            continue
        if any(isinstance(ev, ClearedEvent) for ev in batch.events):
            return i
    return 0
