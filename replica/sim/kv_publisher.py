"""A KV event publisher that speaks vLLM's ZMQ protocol exactly, on asyncio.

Wire contract (vLLM ``ZmqEventPublisher``, ``vllm/distributed/kv_events.py`` 0.32):

* One PUB socket.  It **binds** when the endpoint contains ``*`` or ``::`` or starts with
  ``ipc://`` or ``inproc://``, and **connects** otherwise (so a router can bind one SUB
  that every engine connects to).  ``bind=`` overrides the rule, because kvroute binds
  loopback only (``tcp://127.0.0.1:0`` would otherwise connect).
* Every batch is 3 frames ``[topic, seq (8 bytes big-endian), msgpack payload]``; ``seq``
  counts batches from 0 for each publisher lifetime (``restart()`` starts again at 0, as
  a restarted engine does).
* The last ``buffer_steps`` batches are kept for replay on a bound ROUTER socket.  A
  request is ``[identity, b"", start_seq8]`` (a DEALER sends ``[b"", seq8]``); the reply
  is one message per retained batch with ``seq >= start``: ``[b"", topic, seq8,
  payload]`` (vLLM 0.28+) or ``[b"", seq8, payload]`` (``legacy_replay=True``, vLLM <=
  0.24), then an end marker whose last frame is empty (``END_SEQ`` is 8 bytes 0xff).
  Requests with any other frame count are ignored, as vLLM does.  If ``start`` is older
  than the oldest retained batch, the reply silently starts at the oldest one.
* Payloads are ``index.events.encode_batch`` (tagged maps, 0.24+) or
  ``encode_batch_legacy`` (tagged arrays, <= 0.23) with ``legacy_encoding=True``.
  ``publish_raw`` sends arbitrary bytes (poison pills in tests).

Concurrency: no threads.  Sends happen in the caller's task; replay is served by one task
the publisher owns, cancelled and awaited by ``aclose()`` (or ``async with``).

Fault injection: ``drop_next(n)`` consumes the next ``n`` sequence numbers without
sending them live (they still enter the replay buffer, so replay can fill the gap);
``forget()`` empties the replay buffer (replay then loses history); ``restart()`` resets
the sequence to 0 and empties the buffer, like an engine restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Final

import zmq
import zmq.asyncio

from aio.cancel import cancel_and_wait
from index.discovery import is_bind_endpoint, offset_endpoint_port
from index.events import KVEvent, KVEventBatch, encode_batch, encode_batch_legacy

__all__ = ["END_SEQ", "KVEventPublisher", "is_bind_endpoint", "offset_endpoint_port"]

log = logging.getLogger(__name__)

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay end marker (8 bytes of 0xff)."""
_REPLAY_SLICE_S: Final = 0.005
"""Longest the event loop is held while serving a replay before it is given back."""


class KVEventPublisher:
    """Publishes ``KVEventBatch``es like a vLLM engine core (one per DP rank)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        legacy_encoding: bool = False,
        legacy_replay: bool = False,
        bind: bool | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._hwm = hwm
        self._dp_rank = data_parallel_rank
        self._legacy_encoding = legacy_encoding
        self._legacy_replay = legacy_replay
        self._bind = is_bind_endpoint(endpoint) if bind is None else bind
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._drop = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str = endpoint
        """The live endpoint after ``start`` (a bound ``:0`` port resolved)."""
        self.resolved_replay_endpoint: str | None = replay_endpoint
        """The replay endpoint after ``start`` (a bound ``:0`` port resolved)."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the sockets and start serving replay."""
        if self._pub is not None:
            return
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self._hwm)
        if self._bind:
            pub.bind(self._endpoint)
            self.endpoint = _last_endpoint(pub)
        else:
            pub.connect(self._endpoint)
        self._pub = pub
        if self._replay_endpoint is not None:
            rep = self._ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            rep.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen or 1) + 2)
            rep.bind(self._replay_endpoint)
            self.resolved_replay_endpoint = _last_endpoint(rep)
            self._replay = rep
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    async def aclose(self) -> None:
        """Stop serving replay and close the sockets (idempotent)."""
        task, self._replay_task = self._replay_task, None
        if task is not None:
            await cancel_and_wait(task)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> KVEventPublisher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ publishing

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    async def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int:
        """Publish one batch (one engine step); return its sequence number."""
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=self._dp_rank,
        )
        payload = encode_batch_legacy(batch) if self._legacy_encoding else encode_batch(batch)
        return await self.publish_raw(payload)

    async def publish_raw(self, payload: bytes) -> int:
        """Publish ``payload`` as the next batch, whatever it contains."""
        if self._pub is None:
            raise RuntimeError("publisher not started")
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop > 0:
            self._drop -= 1
            return seq
        await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    # ------------------------------------------------------------------ fault injection

    def drop_next(self, count: int = 1) -> None:
        """Skip sending the next ``count`` batches live (they stay replayable)."""
        self._drop += count

    def forget(self) -> None:
        """Empty the replay buffer, as if its history had rolled over."""
        self._buffer.clear()

    def restart(self) -> None:
        """Behave like a restarted engine: sequence from 0, empty replay buffer."""
        self._seq = 0
        self._drop = 0
        self._buffer.clear()

    # ------------------------------------------------------------------ replay

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            until = time.perf_counter() + _REPLAY_SLICE_S
            for seq, payload in list(self._buffer):
                if seq < start:
                    continue
                if time.perf_counter() >= until:
                    # vLLM serves replay from a thread of its own: a long one must not
                    # hold the simulated engine's steps up either.
                    await asyncio.sleep(0)
                    until = time.perf_counter() + _REPLAY_SLICE_S
                msg: tuple[bytes, ...]
                if self._legacy_replay:
                    msg = (client, b"", seq.to_bytes(8, "big"), payload)
                else:
                    msg = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                await sock.send_multipart(msg)
            if self._legacy_replay:
                await sock.send_multipart((client, b"", END_SEQ, b""))
            else:
                await sock.send_multipart((client, b"", b"", END_SEQ, b""))


def _last_endpoint(sock: zmq.asyncio.Socket) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
