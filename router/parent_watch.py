"""A child process that stops once its parent is gone.

A process started by another (a ``kvroute serve --workers N`` worker, a ``kvroute replay
--jobs N`` job) must not outlive it: killed with SIGKILL, the parent cannot tell it to
stop, and it would go on serving a port unsupervised or computing for nobody.  A daemon
thread polls the parent's pid and sends this process SIGTERM when it changes (the child
was re-parented): a graceful stop where the process handles SIGTERM, the end otherwise.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["stop_with_parent"]


def stop_with_parent(parent: int, *, poll_s: float = 1.0) -> None:
    """SIGTERM to this process once ``parent`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvroute-parent-watch", daemon=True).start()
