"""Cancellation hygiene: generic asyncio helpers, nothing specific to kvroute.

Client libraries sometimes turn a cancellation that lands mid-request into their own
error (a connection error, a timeout), and ``except SomeError:`` would then swallow the
owner's cancel: the task keeps running with nobody waiting for it.  Every handler that
catches network errors calls ``reraise_if_cancelling()`` first.

``cancel_and_wait(task)`` is the one way an owner stops a task it started: cancel it, wait
for it to finish, and let a cancellation of the owner itself propagate.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait", "reraise_if_cancelling"]


def reraise_if_cancelling() -> None:
    """Raise ``CancelledError`` if the current task has a pending cancellation request."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it to finish.

    The ``CancelledError`` the cancel causes is absorbed, unless the caller itself is being
    cancelled (then it propagates); any other exception the task ends with is raised.
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
