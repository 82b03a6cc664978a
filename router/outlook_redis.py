"""The look-ahead bus between routers that share one Redis index
(``router.outlook_peers``): a Redis pub/sub channel, ``<key_prefix>:outlook``.

Every router publishes to the channel and subscribes to it, so routers on several hosts
(and the workers of each) see the whole fleet's requests.  Pub/sub delivers at most
once, to the subscribers connected at the time: a router that subscribes late or
reconnects misses what was said meanwhile, which the peers' in-flight lists and
``PEER_SILENCE_S`` repair within seconds.

A send only appends to a bounded queue (full: the message is dropped and counted); a
publisher loop sends what has queued as one message, a msgpack array of the encoded
messages, so the router pays one Redis round trip per batch, not two per request.
Every Redis call has a timeout; when Redis is unreachable the bus retries with
backoff while the router routes on what it knows.  Its own connections, apart from
the index's (a subscription holds one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from aio.cancel import reraise_if_cancelling
from index.log_limit import RateLimitedLog
from index.redis_store import fail_fast_client

__all__ = ["RedisTransport"]

_log = logging.getLogger(__name__)

_MAX_QUEUED = 50_000
"""Messages waiting for the publisher before sends are dropped (Redis away that long)."""
_MAX_BATCH = 1_000
"""Messages in one publish."""
_BACKOFF_S = (0.5, 5.0)
"""Retry delay after a failed Redis call: first, and the most it doubles to."""
_POLL_S = 1.0
"""How long one read of the subscription waits for a message."""


class RedisTransport:
    """``PeerTransport`` over a Redis pub/sub channel."""

    hears_itself = True

    def __init__(self, url: str, channel: str, *, timeout_s: float = 1.0) -> None:
        self.channel = channel
        self._timeout_s = timeout_s
        self._client = fail_fast_client(url, connect_timeout_s=timeout_s)
        self._queue: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._pubsub: PubSub | None = None
        self._received: deque[bytes] = deque()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(list[bytes]).decode
        self._warn = RateLimitedLog(_log)
        self._receive_backoff = _BACKOFF_S[0]
        self.dropped = 0
        """Messages not published: the queue was full, or Redis refused them."""

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the publisher (dropped when the queue is full)."""
        if len(self._queue) >= _MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append(data)
        self._wake.set()

    def loops(self) -> list[Callable[[], Any]]:
        """The publisher."""
        return [self.run_publisher]

    async def run_publisher(self) -> None:
        """Publish what has queued, a batch per message, until cancelled."""
        backoff = _BACKOFF_S[0]
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                n = min(len(self._queue), _MAX_BATCH)
                batch = [self._queue.popleft() for _ in range(n)]
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await self._client.publish(self.channel, self._encode(batch))
                    backoff = _BACKOFF_S[0]
                except (RedisError, OSError, TimeoutError) as exc:
                    reraise_if_cancelling()
                    self.dropped += len(batch)
                    self._warn.warning("publish", "look-ahead bus: publishing to redis "
                                       "failed (%s); retrying in %.1f s", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, _BACKOFF_S[1])

    async def receive(self) -> bytes:
        """The next message on the channel (this router's own included)."""
        while not self._received:
            await self._read()
        return self._received.popleft()

    async def _read(self) -> None:
        """One read of the subscription (subscribing first), or one backoff after a
        failure."""
        try:
            if self._pubsub is None:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await pubsub.subscribe(self.channel)
                except BaseException:
                    await pubsub.aclose()
                    raise
                self._pubsub = pubsub
            async with asyncio.timeout(_POLL_S + self._timeout_s):
                message = await self._pubsub.get_message(timeout=_POLL_S)
        except (RedisError, OSError, TimeoutError) as exc:
            reraise_if_cancelling()
            await self._drop_subscription()
            self._warn.warning("subscribe", "look-ahead bus: reading the redis channel "
                               "failed (%s); retrying in %.1f s", exc, self._receive_backoff)
            await asyncio.sleep(self._receive_backoff)
            self._receive_backoff = min(2 * self._receive_backoff, _BACKOFF_S[1])
            return
        self._receive_backoff = _BACKOFF_S[0]
        if message is None or message.get("type") != "message":
            return
        data = message.get("data")
        if not isinstance(data, bytes):
            return
        try:
            self._received.extend(self._decode(data))
        except msgspec.DecodeError:
            self._received.append(data)  # not a batch: the bus counts it as invalid

    async def _drop_subscription(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await pubsub.aclose()
            except (RedisError, OSError, TimeoutError):
                reraise_if_cancelling()

    async def aclose(self) -> None:
        """Unsubscribe and close the connections (after the loops stopped)."""
        await self._drop_subscription()
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.aclose()
        except (RedisError, OSError, TimeoutError):
            reraise_if_cancelling()
