"""Where the workers of one ``kvroute serve --workers N`` meet.

The supervisor (``router.workers``) creates a directory only its workers use (mode
0700) and hands each worker a ``WorkerPeers``: that directory, the worker's index and
the number of workers.  What the workers exchange there is ``router.outlook_peers``
(over ``router.outlook_ipc``).  The supervisor removes the directory when it stops;
the last worker out removes it too (a supervisor killed with SIGKILL cannot).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["WorkerPeers"]


@dataclass(frozen=True, slots=True)
class WorkerPeers:
    """The workers' meeting place, this worker's index and how many workers there are."""

    directory: str
    worker: int
    workers: int

    def path(self, worker: int) -> str:
        """The socket file ``worker`` publishes its look ahead's news on."""
        return os.path.join(self.directory, f"outlook-{worker}")

    def address(self, worker: int) -> str:
        """``path`` as a ZMQ endpoint."""
        return "ipc://" + self.path(worker)
