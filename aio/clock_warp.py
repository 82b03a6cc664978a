"""A clock that one process can move forward for several: a benchmark's skipped idle time.

A compressed benchmark (``time_scale`` wall seconds per simulated second) spends much of
its wall time waiting for the trace's next turn while the whole fleet is idle: nothing
in flight, nothing queued, no engine step due.  Waiting there changes nothing but the
clocks, so the benchmark may instead move every clock of the run forward at once: its
simulated replicas', its router's judgement clock and its own schedule.

``ClockWarp`` is that shared offset: seconds added to each participant's monotonic wall
clock, kept as one little-endian double in a file that every participant maps.  The
process that owns the run creates it (``ClockWarp.create``) and calls ``advance``; the
others open it (``ClockWarp.open``) and read ``offset`` on every clock reading (a read
of 8 mapped bytes, no system call).  Advancing is only sound while no participant is
in the middle of something timed: the owner's to decide (``bench.runner`` advances only
when nothing has been in flight for a while and the next turn is far off).

Nothing else is shared; a participant that never opens the file simply keeps wall time.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

__all__ = ["ClockWarp"]

_FORMAT = struct.Struct("<d")


class ClockWarp:
    """The shared offset, in wall seconds (module docstring)."""

    def __init__(self, path: Path, mapped: mmap.mmap) -> None:
        self.path = path
        self._map = mapped

    @classmethod
    def create(cls, path: Path) -> ClockWarp:
        """A new offset file at ``path``, at zero (replacing any file there)."""
        path.write_bytes(_FORMAT.pack(0.0))
        return cls.open(path)

    @classmethod
    def open(cls, path: Path) -> ClockWarp:
        """Map the offset file at ``path`` (``OSError`` if it is missing or too short)."""
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < _FORMAT.size:
                raise OSError(f"{path} is not a clock warp file (under {_FORMAT.size} bytes)")
            mapped = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)
        return cls(path, mapped)

    def offset(self) -> float:
        """Seconds every participant adds to its wall clock now."""
        value: float = _FORMAT.unpack_from(self._map)[0]
        return value

    def advance(self, seconds: float) -> None:
        """Move every participant's clock ``seconds`` forward (never back)."""
        if seconds < 0:
            raise ValueError("a clock warp only moves forward")
        _FORMAT.pack_into(self._map, 0, self.offset() + seconds)

    def close(self) -> None:
        """Unmap the file (the file itself stays for the other participants)."""
        self._map.close()
