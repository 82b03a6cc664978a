"""Receipts: each decision's predicted cached tokens against what the engine reported.

After a response, vLLM's ``usage.prompt_tokens_details.cached_tokens`` (local prefix-cache
hits plus KV-connector hits; only with ``--enable-prompt-tokens-details``) says how much
of the prompt was really served from cache.  ``check_receipt`` joins it with the point
prediction of the decision (``Decision.predicted_cached_tokens``: what the replica holds
per the index, after the last-token rule), giving a signed error per request:

* ``error = actual - predicted``: negative means the router promised a hit the engine did
  not deliver (stale index, eviction before scheduling, rendering mismatch);
* a disagreement is *large* when ``|error| > max(large_abs_tokens, large_rel *
  prompt_tokens)``: a sign that rendering, hashing or the index is wrong, not noise.

``ReceiptCalibration`` turns the receipts of one replica into a trust factor in
``[floor, 1]`` (an exponentially weighted mean of ``min(1, actual / predicted)`` over
requests with a positive prediction), which the scoring multiplies into that replica's
hit probability: a replica whose hits keep not materialising is believed less.  Callers
feed it only predictions that came from the index (not provisional entries, whose
shortfall in a same-step burst is expected).  Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvkeys.types import ReplicaId

__all__ = ["ReceiptCalibration", "ReceiptCheck", "ReceiptOutcome", "check_receipt"]

ReceiptOutcome = Literal["match", "over", "under", "missing"]
"""``over``: predicted more than served; ``under``: less; ``missing``: no usage report."""


@dataclass(frozen=True, slots=True)
class ReceiptCheck:
    """One decision checked against its receipt."""

    replica: ReplicaId
    predicted: int
    actual: int | None
    error: int | None
    outcome: ReceiptOutcome
    large: bool


def check_receipt(
    replica: ReplicaId,
    predicted: int,
    actual: int | None,
    prompt_tokens: int | None,
    *,
    large_abs_tokens: int = 64,
    large_rel: float = 0.1,
) -> ReceiptCheck:
    """Compare a prediction with the engine's report (see the module docstring)."""
    if actual is None:
        return ReceiptCheck(replica, predicted, None, None, "missing", False)
    error = actual - predicted
    outcome: ReceiptOutcome = "match" if error == 0 else ("over" if error < 0 else "under")
    threshold = max(float(large_abs_tokens), large_rel * float(prompt_tokens or 0))
    return ReceiptCheck(replica, predicted, actual, error, outcome, abs(error) > threshold)


class ReceiptCalibration:
    """Per-replica trust in predicted hits, learned from receipts."""

    def __init__(self, *, weight: float = 0.05, floor: float = 0.2) -> None:
        self.weight = weight
        self.floor = floor
        self._trust: dict[ReplicaId, float] = {}

    def observe(self, replica: ReplicaId, predicted: int, actual: int | None) -> None:
        """Fold one receipt in (ignored without a positive prediction or a report)."""
        if actual is None or predicted <= 0:
            return
        ratio = min(1.0, max(0.0, actual / predicted))
        current = self._trust.get(replica, 1.0)
        self._trust[replica] = max(self.floor, current + self.weight * (ratio - current))

    def trust(self, replica: ReplicaId) -> float:
        """The trust factor for ``replica`` (1 until receipts say otherwise)."""
        return self._trust.get(replica, 1.0)

    def forget(self, replica: ReplicaId) -> None:
        """Reset a replica's calibration (it restarted)."""
        self._trust.pop(replica, None)
