"""``asyncio.run`` for the ``kvroute`` bench subcommands: SIGTERM cancels like Ctrl-C, so
a fleet's ``async with`` stops every child process on the way out."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_main"]

T = TypeVar("T")


def run_main(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` that also turns SIGTERM into a cancellation (clean child shutdown);
    either signal surfaces as ``KeyboardInterrupt`` once everything is stopped."""

    async def main() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            try:
                loop.add_signal_handler(signal.SIGTERM, task.cancel)
            except (NotImplementedError, RuntimeError):
                pass
        return await coro

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:  # SIGTERM: the main task was cancelled and cleaned up
        raise KeyboardInterrupt from None
