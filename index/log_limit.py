"""Log lines that a misbehaving peer cannot turn into a flood.

``RateLimitedLog`` writes at most one line per key per ``interval_s`` and says, on the
next line it writes for that key, how many it held back.  Keys are small fixed sets (an
event source's failure reasons), so its memory is bounded by the caller's choice of keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most one ``WARNING`` line per key per ``interval_s``."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line for ``key`` was written less than
        ``interval_s`` ago; return whether it was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        if held:
            self._log.warning(msg + " (%d such lines held back)", *args, held)
        else:
            self._log.warning(msg, *args)
        return True
