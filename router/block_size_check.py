"""The configured block size of a model against the one its replicas really use.

Prompt keys are hashed in blocks of the configured ``scoring.models[].block_size``;
event keys in blocks of the size each ``BlockStored`` carries (the replica's
``--block-size``).  When the two differ no prompt key ever meets an event key, and every
prediction for the model is silently wrong.  ``BlockSizeCheck`` watches the applied
batches (it is an ``IngestObserver``) and, from a replica's first stored blocks:

* logs one error per (model, replica, size) naming the model, both sizes and the fix;
* counts every batch stored with the wrong size in
  ``router_kv_block_size_mismatch_total{model}``;
* turns the model's predictions off: ``disabled(model)`` is true (the prompt source
  then gives no prompt, so the policy routes by affinity, reason
  ``affinity_no_prompt``) while any of its replicas last stored blocks of another size.
  A replica restarted with the configured size turns them back on.

Models learnt at run time (``scoring.auto_models``) take the replicas' size and are not
checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import Counter

from index.event_applier import BatchResult
from kvkeys.types import ReplicaId

__all__ = ["BlockSizeCheck"]

_log = logging.getLogger(__name__)


class BlockSizeCheck:
    """Compares each source's stored block size with its model's configured one."""

    def __init__(
        self,
        configured: Mapping[str, int],
        *,
        model_of: Callable[[ReplicaId], str | None],
        base_of: Callable[[str], str | None] = lambda model: model,
        mismatches: Counter | None = None,
    ) -> None:
        self._configured = dict(configured)
        self._model_of = model_of
        self._base_of = base_of
        self._counter = mismatches
        self._wrong: dict[ReplicaId, tuple[str, int]] = {}
        self._logged: set[tuple[str, ReplicaId, int]] = set()

    def disabled(self, model: str) -> bool:
        """Whether predictions for ``model`` (a base model or one of its adapters) are
        off because a replica stores blocks of another size than configured."""
        if not self._wrong:
            return False
        base = self._base_of(model)
        return any(m == base for m, _ in self._wrong.values())

    def observe(self, replica: ReplicaId, block_size: int | None) -> None:
        """Record the block size of ``replica``'s last stored blocks."""
        if block_size is None:
            return
        model = self._model_of(replica)
        want = self._configured.get(model) if model is not None else None
        if model is None or want is None:
            return
        if block_size == want:
            self._wrong.pop(replica, None)
            return
        self._wrong[replica] = (model, block_size)
        if self._counter is not None:
            self._counter.labels(model).inc()
        if (model, replica, block_size) not in self._logged:
            self._logged.add((model, replica, block_size))
            _log.error(
                "model %r is configured with block_size %d but replica %s stores blocks of "
                "%d tokens: no prediction could ever hit, so KV predictions for %r are off "
                "until they agree. Fix: set scoring.models[name=%r].block_size to %d (the "
                "replicas' --block-size), or start the replicas with --block-size %d",
                model, want, replica, block_size, model, model, block_size, want,
            )  # fmt: skip

    # IngestObserver

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        """Check the block size of the batch's stores."""
        self.observe(replica, result.block_size)

    def gap(self, replica: ReplicaId) -> None:
        """Not relevant."""

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        """Not relevant."""

    def resync(self, replica: ReplicaId, reason: str) -> None:
        """Not relevant."""
