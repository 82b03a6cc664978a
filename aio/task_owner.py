"""An owner for background tasks: every task the app starts has one, and one shutdown path.

``TaskOwner.spawn`` keeps a strong reference (asyncio only keeps weak ones), logs a task
that dies with an exception (it is not silently lost), and ``aclose`` cancels whatever is
left and awaits it, suppressing the ``CancelledError`` it caused.  The lifespan enters it
in its ``AsyncExitStack``, so teardown happens in reverse order of start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

__all__ = ["TaskOwner"]

_log = logging.getLogger(__name__)


class TaskOwner:
    """Owns background tasks; an async context manager that cancels them on exit."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

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
