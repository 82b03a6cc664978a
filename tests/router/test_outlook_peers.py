"""The look ahead shared between router workers (``router.outlook_peers``): two workers'
buses on real ZMQ IPC sockets, each applying the other's requests to its look ahead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from router.fleet_outlook import FleetOutlook
from router.horizon import HorizonEstimator
from router.outlook_ipc import IpcTransport
from router.outlook_peers import OutlookPeers
from router.worker_peers import WorkerPeers
from tests.router.outlook_helpers import A, outlook, pinned, prompt, until


@dataclass
class _Worker:
    outlook: FleetOutlook
    horizon: HorizonEstimator
    peers: OutlookPeers



@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[list[_Worker]]:
    """Two workers' look aheads joined by their buses (loops running), once each hears
    the other (a SUB socket misses what is published before it has connected)."""
    now = [100.0]
    made = []
    for i in range(2):
        out, h = outlook()
        peers = OutlookPeers(IpcTransport(WorkerPeers(str(tmp_path), i, 2)), i,
                             lambda: now[0])
        peers.attach(out)
        made.append(_Worker(out, h, peers))
    loops = [asyncio.create_task(w.peers.run()) for w in made]
    try:
        for sender, hearer in ((made[0].peers, made[1].peers), (made[1].peers, made[0].peers)):
            await until(partial(_heard, hearer),
                         partial(sender._send, ("s", sender.sender, [])))
        for w in made:
            w.peers.received = 0
        yield made
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for w in made:
            await w.peers.transport.aclose()



def _heard(peers: OutlookPeers) -> bool:
    return peers.received > 0




async def test_a_request_one_worker_routes_pins_its_blocks_in_the_others_look_ahead(
    workers: list[_Worker],
) -> None:
    w0, w1 = workers
    w0.outlook.routed("req-1", "s1", A, prompt(800), [], None, 100.0)
    await until(lambda: w1.peers.received >= 1)
    assert pinned(w1.outlook) == pinned(w0.outlook) == 50.0
    # It finishes: unpinned there too, its service time learnt, its session's pause
    # started (a paused run of 60 blocks on A) and its blocks back in the free pool.
    w0.outlook.finished("req-1", "s1", A, 60, 0.2, 30, 102.0)
    await until(lambda: w1.peers.received >= 2)
    assert pinned(w1.outlook) == 0.0
    assert len(w1.outlook._service) == 1
    assert w1.outlook.idle_runs.replica_of("s1") == A
    assert w1.horizon._r[A].released == 60.0
    assert w1.outlook._reply_tokens == 30.0
    # Nothing echoes back to the sender.
    await asyncio.sleep(0.05)
    assert w0.peers.received == 0 and len(w0.outlook._service) == 1


async def test_the_in_flight_list_drops_a_request_whose_finish_was_lost(
    workers: list[_Worker],
) -> None:
    w0, w1 = workers
    w0.outlook.routed("req-1", None, A, prompt(800), [], None, 100.0)
    w0.outlook.routed("req-2", None, A, prompt(320), [], None, 100.0)
    await until(lambda: w1.peers.received >= 2)
    assert pinned(w1.outlook) == 70.0
    # req-1's finish never reaches worker 1 (a full queue, a restart): the next list of
    # worker 0's requests in flight no longer names it, so its pins go, unlearnt.
    w0.peers._mine.discard("req-1")
    w0.peers._send(("s", 0, sorted(w0.peers._mine)))
    await until(lambda: w1.peers.received >= 3)
    assert pinned(w1.outlook) == 20.0
    assert len(w1.outlook._service) == 0


async def test_a_malformed_message_is_counted_and_the_loop_goes_on(
    workers: list[_Worker],
) -> None:
    w0, w1 = workers
    for junk in (b"\xc1", b"\x93\xa1r\x00\xa1x", b"\x92\xa1q\x00"):
        w0.peers.transport.send(junk)
    w0.peers._send(("r", 1, "x", None, "a", 1.0, None))  # it claims to come from worker 1
    w0.peers._send(("r", 0, "x", None, "a", "many", None))  # blocks not a number
    w0.outlook.routed("req-1", None, A, prompt(800), [], None, 100.0)
    await until(lambda: w1.peers.received >= 1)
    assert w1.peers.invalid == 5
    assert pinned(w1.outlook) == 50.0
