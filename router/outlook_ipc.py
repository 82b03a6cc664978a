"""The look-ahead bus between the workers of one ``kvroute serve --workers N``
(``router.outlook_peers``): ZMQ PUB/SUB over IPC sockets.

The sockets live in a directory only the supervisor's workers use
(``router.worker_peers``, created with mode 0700 by ``router.workers``): worker ``i``
publishes on ``outlook-i`` and subscribes to every other worker's.  A send never blocks
(a PUB socket drops what a slow subscriber cannot take).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from router.worker_peers import WorkerPeers

__all__ = ["IpcTransport"]

_HWM = 100_000
"""Messages queued per peer before the PUB socket drops (a peer stalled that long)."""


class IpcTransport:
    """``PeerTransport`` over the workers' IPC sockets."""

    hears_itself = False
    dropped = None
    """Not counted: a PUB socket drops what a stalled subscriber cannot take, silently."""

    def __init__(self, peers: WorkerPeers) -> None:
        self.peers = peers
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

    def send(self, data: bytes) -> None:
        """Publish ``data`` to the other workers (dropped if a peer's queue is full)."""
        self._pub.send(data, zmq.NOBLOCK)

    async def receive(self) -> bytes:
        """The next message from another worker."""
        data: bytes = await self._sub.recv()
        return data

    def loops(self) -> list[Callable[[], Any]]:
        """None: ZMQ's own threads carry the messages."""
        return []

    async def aclose(self) -> None:
        """Close the sockets and remove this worker's socket file, and the directory if
        it was the last."""
        self._pub.close(linger=0)
        self._sub.close(linger=0)
        self._pub_ctx.term()
        self._sub_ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(self.peers.path(self.peers.worker))
        with contextlib.suppress(OSError):  # not empty: another worker is still there
            os.rmdir(self.peers.directory)
