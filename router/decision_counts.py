"""What one ``kv`` decision adds to the metrics and the debug log, beyond its
prediction: the hit a later turn gives up by moving and what a replica still held when a
session came back to it, the look ahead's forecasts for the chosen replica, and one
DEBUG line with every candidate's score."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvkeys.types import ReplicaId
from router.fleet_outlook import OutlookTerms
from router.kv_choice import Choice
from router.metrics import KvMetrics
from router.policy import Decision, RouteRequest

__all__ = ["count_moves", "count_outlook", "log_decision"]

_log = logging.getLogger("router.kv_policy")


def count_moves(
    m: KvMetrics, last: ReplicaId, left_before: ReplicaId | None, choice: Choice
) -> None:
    """A later turn whose previous turn ran on ``last``: if it leaves, the expected hit
    it gives up there; if it goes back to ``left_before`` (the replica the session
    moved away from earlier), what that replica still held."""
    chosen = choice.chosen
    if chosen.replica == last:
        return
    home = next((s for s in choice.ordered if s.replica == last), None)
    if home is not None and home.expected_cached_tokens > chosen.expected_cached_tokens:
        m.moved_given_up_tokens.labels(last).inc(
            home.expected_cached_tokens - chosen.expected_cached_tokens)
    if chosen.replica == left_before:
        m.came_back_turns.labels(chosen.replica).inc()
        m.came_back_held_tokens.labels(chosen.replica).inc(chosen.predicted_cached_tokens)


def count_outlook(
    m: KvMetrics, replica: ReplicaId, terms: Mapping[ReplicaId, OutlookTerms]
) -> None:
    """The look ahead's forecasts for the chosen replica, into ``router_kv_outlook_*``."""
    chosen = terms.get(replica)
    if chosen is None:
        return
    m.outlook_displaced_tokens.labels(replica).inc(chosen.displaced_tokens)
    m.outlook_retained_tokens.labels(replica).inc(chosen.retained_tokens)
    m.outlook_pool_wait.labels(replica).inc(chosen.pool_wait_s)


def log_decision(
    request: RouteRequest, decision: Decision[Any], choice: Choice, n_tokens: int
) -> None:
    """One DEBUG line per decision with the score breakdown (the ``kv`` policy's log)."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    _log.debug(
        "route %s kv reason=%s chosen=%s prompt=%d predicted=%s scores=%s",
        request.request_id, decision.reason, decision.replica, n_tokens,
        decision.predicted_cached_tokens,
        [(s.replica, round(s.score, 1), round(s.expected_cached_tokens, 1),
          s.queued_prefill_tokens, s.decode_load, round(s.p_index, 2),
          round(s.p_resident_tail, 2)) for s in choice.ordered],
    )
