"""The look ahead shared between router workers (``kvroute serve --workers N``).

The ``kv`` policy's look ahead (``router.fleet_outlook``) forecasts from what the
router has seen: the blocks every request in flight pins (will the next one fit?), the
paused conversations on each replica (what a placement evicts), the service times,
TTFTs and think times.  Under ``--workers N`` the kernel deals each connection to one
worker, so each worker would see one N-th of the fleet's requests and think the pools
emptier than they are: in the replay, two routers each with their own look ahead had
a TTFT p99 four times one router's at a tight pool (``kvroute replay --routers 2
--no-shared-outlook``).  So each worker tells the others what its look ahead learns,
and applies what they tell it:

* ``r`` (routed): request id, session, replica, the blocks it pins, its session's
  think time;
* ``f`` (finished): request id, session, replica, blocks released, TTFT, reply tokens;
* ``s`` (in flight, every ``SYNC_S``): the ids of the sender's requests still in
  flight.  A peer drops the pins of that sender's requests not listed (a finish it
  missed: a full queue, a worker that restarted), so a lost message costs a little
  foresight for a second, never a pin held forever.

With it two routers' kv TTFT p99 at that pool is 488 ms against one router's 433 (24
seeds; without it 1,607), and through HTTP two workers' 350 ms against 1,776 (one
worker 265; README, "A fleet that changes").

Times travel as durations, never timestamps: each worker applies a message on its own
clock when it arrives (under a millisecond after it was sent).

Transport: ZMQ PUB/SUB over IPC sockets in a directory only the supervisor's workers
use (``router.worker_peers``, created with mode 0700 by ``router.workers``): worker
``i`` publishes on ``outlook-i`` and subscribes to every other worker's.  Messages are
msgpack arrays (tagged, positional msgspec structs: a message of the wrong shape or
types fails to decode).  A send never blocks (a PUB socket drops what a slow subscriber cannot
take); a message that does not decode is counted and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from aio.task_owner import TaskOwner
from kvkeys.types import ReplicaId
from router.fleet_outlook import FleetOutlook
from router.worker_peers import WorkerPeers

__all__ = ["SYNC_S", "OutlookPeers", "PeerMessagesCollector", "open_outlook_peers"]

_log = logging.getLogger(__name__)

SYNC_S = 1.0
"""How often a worker lists its requests in flight to the others."""
_HWM = 100_000
"""Messages queued per peer before the PUB socket drops (a peer stalled that long)."""


class _Routed(msgspec.Struct, array_like=True, tag="r", frozen=True):
    sender: int
    request_id: str
    session: str | None
    replica: str
    blocks: float
    think_s: float | None


class _Finished(msgspec.Struct, array_like=True, tag="f", frozen=True):
    sender: int
    request_id: str
    session: str | None
    replica: str
    released: int | None
    ttft_s: float | None
    reply_tokens: int | None


class _InFlight(msgspec.Struct, array_like=True, tag="s", frozen=True):
    sender: int
    request_ids: list[str]


class PeerMessagesCollector:
    """``router_outlook_peer_messages_total{outcome}``: the other workers' messages this
    worker applied or skipped (malformed), read at scrape time."""

    def __init__(self, peers: OutlookPeers) -> None:
        self._peers = peers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "router_outlook_peer_messages", "Look-ahead messages from the other workers "
            "(kvroute serve --workers N), by outcome", labels=["outcome"])
        family.add_metric(["applied"], self._peers.received)
        family.add_metric(["invalid"], self._peers.invalid)
        yield family


class OutlookPeers:
    """``OutlookFeed`` to the other workers, and what applies theirs to this worker's
    look ahead (``attach``).  ``run`` (receive) and ``run_sync`` (list what is in
    flight) are the owner's loops; ``close`` the sockets after they stop."""

    def __init__(self, peers: WorkerPeers, clock: Callable[[], float]) -> None:
        self.peers = peers
        self._clock = clock
        self._pub_ctx = zmq.Context()
        self._sub_ctx = zmq.asyncio.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, _HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        os.makedirs(peers.directory, mode=0o700, exist_ok=True)
        self._pub.bind(peers.address(peers.worker))
        self._sub = self._sub_ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, _HWM)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for w in range(peers.workers):
            if w != peers.worker:
                self._sub.connect(peers.address(w))
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(_Routed | _Finished | _InFlight).decode
        self._outlook: FleetOutlook | None = None
        self._mine: set[str] = set()
        """This worker's requests in flight (what ``s`` lists)."""
        self._theirs: dict[int, set[str]] = {}
        """Per peer, its requests in flight that this worker's look ahead holds."""
        self.received = 0
        self.invalid = 0

    def attach(self, outlook: FleetOutlook) -> None:
        """Tell the peers what ``outlook`` learns, and apply theirs to it."""
        self._outlook = outlook
        outlook.feed = self

    # ------------------------------------------------------------------ OutlookFeed
    def routed(self, request_id: str, session: str | None, replica: ReplicaId,
               blocks: float, think_s: float | None) -> None:
        """This worker routed a request: tell the others."""
        self._mine.add(request_id)
        self._send(_Routed(self.peers.worker, request_id, session, replica, blocks, think_s))

    def finished(self, request_id: str, session: str | None, replica: ReplicaId,
                 released: int | None, ttft_s: float | None,
                 reply_tokens: int | None) -> None:
        """One of this worker's requests finished: tell the others."""
        self._mine.discard(request_id)
        self._send(_Finished(self.peers.worker, request_id, session, replica, released,
                             ttft_s, reply_tokens))

    def _send(self, message: Any) -> None:
        self._pub.send(self._encode(message), zmq.NOBLOCK)

    # ------------------------------------------------------------------ loops
    async def run(self) -> None:
        """Apply every message the other workers publish, until cancelled."""
        while True:
            data = await self._sub.recv()
            try:
                self.apply(data)
            except (msgspec.DecodeError, ValueError) as exc:
                self.invalid += 1
                _log.debug("outlook message from a peer skipped: %s", exc)

    async def run_sync(self) -> None:
        """List this worker's requests in flight every ``SYNC_S``, until cancelled."""
        while True:
            await asyncio.sleep(SYNC_S)
            self._send(_InFlight(self.peers.worker, sorted(self._mine)))

    def apply(self, data: bytes) -> None:
        """One peer message, on this worker's clock (raises on a malformed one)."""
        msg = self._decode(data)
        if msg.sender == self.peers.worker:
            raise ValueError(f"a message from this worker ({msg.sender})")
        outlook = self._outlook
        theirs = self._theirs.setdefault(msg.sender, set())
        now = self._clock()
        if isinstance(msg, _Routed):
            theirs.add(msg.request_id)
            if outlook is not None:
                outlook.peer_routed(msg.request_id, msg.session, ReplicaId(msg.replica),
                                    msg.blocks, msg.think_s, now)
        elif isinstance(msg, _Finished):
            theirs.discard(msg.request_id)
            if outlook is not None:
                outlook.peer_finished(msg.request_id, msg.session, ReplicaId(msg.replica),
                                      msg.released, msg.ttft_s, msg.reply_tokens, now)
        else:
            listed = set(msg.request_ids)
            for rid in theirs - listed:
                if outlook is not None:
                    outlook.peer_forgot(rid)
            theirs &= listed
        self.received += 1

    def close(self) -> None:
        """Close the sockets (the loops stopped first) and remove this worker's socket
        file, and the directory if it was the last."""
        self._pub.close(linger=0)
        self._sub.close(linger=0)
        self._pub_ctx.term()
        self._sub_ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(self.peers.path(self.peers.worker))
        with contextlib.suppress(OSError):  # not empty: another worker is still there
            os.rmdir(self.peers.directory)


@asynccontextmanager
async def open_outlook_peers(
    peers: WorkerPeers | None, *, clock: Callable[[], float], tasks: TaskOwner,
    registry: CollectorRegistry,
) -> AsyncIterator[OutlookPeers | None]:
    """Under ``--workers N`` with several workers (``peers``): the bus to the others,
    its two loops owned by ``tasks`` and stopped before the sockets close, its counters
    in ``registry``; ``None`` for a single process."""
    if peers is None or peers.workers < 2:
        yield None
        return
    bus = OutlookPeers(peers, clock)
    counters = PeerMessagesCollector(bus)
    registry.register(counters)
    loops = [tasks.supervise(bus.run, name="outlook-peers"),
             tasks.supervise(bus.run_sync, name="outlook-peers-sync")]
    try:
        yield bus
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        bus.close()
        registry.unregister(counters)
