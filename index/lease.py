"""Exactly one ingesting process per event source, with a Redis lease.

With a shared Redis index, every router may run ingestion for every replica, but only the
holder of ``<ns>:lease:<replica>`` applies that replica's events; the others stand by and
read.  The lease is a Redis string holding the owner's id with a TTL (``SET NX PX``);
the holder renews it every ``ttl_s / 3`` (compare-and-expire in Lua) and releases it on
shutdown (compare-and-delete).  If the holder stops renewing (crash, partition, pause),
the key expires and another process takes over after at most ``ttl_s``.

Safety against a holder that lost the lease without noticing (e.g. paused longer than
the TTL): ``RedisLease.valid()`` is a local deadline, ``ttl_s`` minus a margin after the
last successful acquire/renew, computed from the time the request was *sent*; work is
cancelled as soon as it passes, before the key can expire in Redis.  A new holder
always rebuilds the replica (clear + replay from 0), so what a previous holder applied
does not matter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from aio.cancel import cancel_and_wait, reraise_if_cancelling

__all__ = ["RedisLease", "run_with_lease"]

log = logging.getLogger(__name__)

_RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLease:
    """A named lease held by ``owner`` for ``ttl_s`` seconds at a time."""

    def __init__(
        self,
        client: aioredis.Redis,
        key: str,
        owner: str,
        *,
        ttl_s: float = 10.0,
        op_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.key = key
        self.owner = owner
        self.ttl_s = ttl_s
        self._r = client
        self._timeout = min(op_timeout_s, ttl_s / 3)
        self._clock = clock
        self._deadline = -1e18
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def valid(self) -> bool:
        """Whether this process may still act as the holder."""
        return self._clock() < self._deadline

    def _granted(self, sent_at: float) -> None:
        self._deadline = sent_at + self.ttl_s * 0.8

    async def try_acquire(self) -> bool:
        """Take the lease if it is free (or already ours); ``False`` on any failure."""
        sent = self._clock()
        ms = int(self.ttl_s * 1000)
        try:
            async with asyncio.timeout(self._timeout):
                if await self._r.set(self.key, self.owner, nx=True, px=ms):
                    self._granted(sent)
                    return True
                if await self._renew(keys=[self.key], args=[self.owner, ms]):
                    self._granted(sent)
                    return True
        except (TimeoutError, RedisError, OSError) as exc:
            reraise_if_cancelling()
            log.debug("lease %s: acquire failed: %s", self.key, exc)
        return False

    async def renew(self) -> bool:
        """Extend the lease; ``False`` if it is lost or Redis did not answer."""
        sent = self._clock()
        try:
            async with asyncio.timeout(self._timeout):
                ok = await self._renew(keys=[self.key], args=[self.owner, int(self.ttl_s * 1000)])
        except (TimeoutError, RedisError, OSError) as exc:
            reraise_if_cancelling()
            log.debug("lease %s: renew failed: %s", self.key, exc)
            return False
        if ok:
            self._granted(sent)
            return True
        self._deadline = -1e18
        return False

    async def release(self) -> None:
        """Give the lease up if we hold it (best effort)."""
        self._deadline = -1e18
        try:
            async with asyncio.timeout(self._timeout):
                await self._release(keys=[self.key], args=[self.owner])
        except (TimeoutError, RedisError, OSError) as exc:
            log.debug("lease %s: release failed: %s", self.key, exc)

    async def holder(self) -> str | None:
        """Who holds the lease now (``None`` if free or unknown)."""
        try:
            async with asyncio.timeout(self._timeout):
                value = await self._r.get(self.key)
        except (TimeoutError, RedisError, OSError):
            reraise_if_cancelling()
            return None
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it, without swallowing a cancellation of our own."""
    try:
        await cancel_and_wait(task)
    except Exception:  # noqa: BLE001 - reported by the caller through task.exception()
        pass


async def run_with_lease(
    lease: RedisLease,
    work: Callable[[], Coroutine[Any, Any, None]],
    *,
    on_standby: Callable[[], None] | None = None,
) -> None:
    """Run ``work`` whenever ``lease`` is held; cancel it when the lease is lost; try to
    take the lease again every ``ttl_s / 3``.  Runs until cancelled, then releases."""
    period = lease.ttl_s / 3
    try:
        while True:
            reraise_if_cancelling()
            if not await lease.try_acquire():
                if on_standby is not None:
                    on_standby()
                await asyncio.sleep(period)
                continue
            log.info("lease %s acquired by %s", lease.key, lease.owner)
            worker = asyncio.create_task(work(), name=f"leased:{lease.key}")
            try:
                while not worker.done():
                    reraise_if_cancelling()
                    done, _ = await asyncio.wait({worker}, timeout=period)
                    if done:
                        break
                    await lease.renew()
                    if not lease.valid():
                        log.warning("lease %s lost by %s", lease.key, lease.owner)
                        break
            finally:
                await _cancel_and_wait(worker)
            if not worker.cancelled() and worker.exception() is not None:
                raise RuntimeError(f"leased work for {lease.key} failed") from worker.exception()
    finally:
        await asyncio.shield(lease.release())
