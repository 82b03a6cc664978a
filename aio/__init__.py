"""``aio``: generic asyncio helpers, with no kvroute concept in them.

A retry schedule (``Backoff``), cancellation hygiene (``reraise_if_cancelling``,
``cancel_and_wait``) and an owner for background tasks (``TaskOwner``).  Any package may
import it; it imports nothing of ours.
"""

from __future__ import annotations

from aio.backoff import Backoff
from aio.cancel import cancel_and_wait, reraise_if_cancelling
from aio.task_owner import TaskOwner

__all__ = ["Backoff", "TaskOwner", "cancel_and_wait", "reraise_if_cancelling"]
