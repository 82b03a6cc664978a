"""Cancellation hygiene shared by the index's network code.

Client libraries sometimes turn a cancellation that lands mid-request into their own
error (a connection error, a timeout), and ``except SomeError:`` would then swallow the
owner's cancel: the task keeps running with nobody waiting for it.  Every handler that
catches network errors calls ``reraise_if_cancelling()`` first.
"""

from __future__ import annotations

import asyncio

__all__ = ["reraise_if_cancelling"]


def reraise_if_cancelling() -> None:
    """Raise ``CancelledError`` if the current task has a pending cancellation request."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
