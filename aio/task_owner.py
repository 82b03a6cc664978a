"""An owner for background tasks: every task the app starts has one, and one shutdown path.

``TaskOwner.spawn`` keeps a strong reference (asyncio only keeps weak ones), logs a task
that dies with an exception (it is not silently lost), and ``aclose`` cancels whatever is
left and awaits it, suppressing the ``CancelledError`` it caused.  The lifespan enters it
in its ``AsyncExitStack``, so teardown happens in reverse order of start-up.

``TaskOwner.supervise`` is for the long-lived loops (health prober, KV event ingestion,
metrics scraper, gauges): a run that fails is logged and started again with a backoff
(``aio.supervisor``), so a bug met once does not leave the router without the loop
for the rest of its life.  ``health()`` names the loops that failed recently (the
router's ``/ready`` detail and metrics).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from aio.backoff import Backoff
from aio.supervisor import Supervisor, SupervisorHealth

__all__ = ["TaskOwner"]

_log = logging.getLogger(__name__)


class TaskOwner:
    """Owns background tasks; an async context manager that cancels them on exit."""

    def __init__(
        self, *, restart_backoff: Backoff | None = None, healthy_after_s: float = 30.0
    ) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        backoff = restart_backoff or Backoff(0.5, 30.0, rng=random.Random())
        self._sup = Supervisor(backoff, healthy_after_s=healthy_after_s)

    def supervise(
        self, start: Callable[[], Coroutine[Any, Any, Any]], *, name: str
    ) -> asyncio.Task[Any]:
        """Run ``start()`` as an owned task, starting it again (with backoff) whenever a
        run fails; a run that returns ends it."""
        return self.spawn(self._sup.run([(name, start)]), name=name)

    def health(self) -> SupervisorHealth:
        """Supervised tasks that failed recently, and their restart counts."""
        return self._sup.health()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Start ``coro`` as an owned task."""
        if self._closed:
            coro.close()
            raise RuntimeError("TaskOwner is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        """Cancel every owned task and wait for them to finish."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> TaskOwner:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

