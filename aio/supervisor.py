"""Keeping a set of independent tasks running: one's failure never stops another.

``Supervisor.run(children)`` runs every child concurrently until cancelled.  A child that
returns is done; a child that raises is logged with its traceback, counted, and started
again after a backoff (``aio.backoff``; consecutive failures grow it, a run that lasted
``healthy_after_s`` resets it).  Nothing a child raises reaches its siblings or the
caller: unlike a ``TaskGroup``, where the first error cancels every task, which is how
one malformed KV event once stopped the ingestion of every replica.  Cancelling ``run``
cancels and awaits every child.

``health()`` is a snapshot for readiness and metrics: the children that failed within
the last ``healthy_after_s`` (not ok), and every child's restart count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aio.backoff import Backoff
from aio.cancel import reraise_if_cancelling

__all__ = ["Child", "Supervisor", "SupervisorHealth"]

log = logging.getLogger(__name__)

Child = tuple[str, Callable[[], Awaitable[None]]]
"""A child's name (unique, from configuration) and what starts one run of it."""


@dataclass(frozen=True, slots=True)
class SupervisorHealth:
    """A snapshot of the supervised children."""

    failing: dict[str, str]
    """Children that failed within ``healthy_after_s``: name -> the last error."""
    restarts: dict[str, int]
    """Failures (each followed by a restart) per child since start."""

    @property
    def ok(self) -> bool:
        """No child failed recently."""
        return not self.failing


class Supervisor:
    """Runs children, restarting each one that fails (see the module docstring)."""

    def __init__(
        self,
        backoff: Backoff,
        *,
        healthy_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backoff = backoff
        self._healthy_after = healthy_after_s
        self._clock = clock
        self._restarts: dict[str, int] = {}
        self._failed: dict[str, tuple[float, str]] = {}

    def health(self) -> SupervisorHealth:
        """Which children failed recently, and how often each was restarted."""
        now = self._clock()
        failing = {name: err for name, (at, err) in self._failed.items()
                   if now - at < self._healthy_after}  # fmt: skip
        return SupervisorHealth(failing, dict(self._restarts))

    async def run(self, children: Sequence[Child]) -> None:
        """Run ``children`` until each has returned, or until cancelled."""
        if children:
            await asyncio.gather(*(self._keep(name, start) for name, start in children))

    async def _keep(self, name: str, start: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        while True:
            began = self._clock()
            try:
                await start()
                return
            except Exception as exc:  # noqa: BLE001 - the supervision boundary (module doc)
                reraise_if_cancelling()
                now = self._clock()
                failures = 1 if now - began >= self._healthy_after else failures + 1
                self._restarts[name] = self._restarts.get(name, 0) + 1
                self._failed[name] = (now, _describe(exc))
                delay = self._backoff.compute(failures)
                log.error("%s failed; restarting it in %.2f s", name, delay, exc_info=exc)
                await asyncio.sleep(delay)


def _describe(exc: BaseException) -> str:
    """``Type: message`` of the error, looking inside single-error groups (task groups)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]
