"""What the ``kv`` policy learns from a conversation's turns and from receipts.

* **Turns** (``turn``): each routed turn of a session (an ``affinity_key`` from the
  session header or the first message) goes into the ``SessionTable``; the previous
  turn gives stickiness (same replica or moved), think time (against the replica's
  eviction horizon) and, for header sessions, a prefix-break check (``prefix_breaks``:
  did this prompt rewrite what the last one cached?).
* **Tails** (``tail``): how much of the previous replica's free pool has been allocated
  since the session's last turn finished, and where its blocks sat in the LRU queue
  (``SessionTail``, for the scoring's eviction term).
* **Finishes** (``finished``): a finished turn marks the replica's allocation count and
  free pool, and returns its blocks to the pool estimate (``router.horizon``).
* **Receipts** (``receipt``): the engine's reported ``cached_tokens`` checked against
  the prediction (``router.receipts``): counters, the error histogram, the per-replica
  calibration.

Metrics are optional; every method is synchronous, and times are passed in.
"""

from __future__ import annotations

import logging
import math

from kvkeys.types import ReplicaId, RequestKey
from prompt.keyer import Prompt
from router.affinity import AffinityKey
from router.horizon import HorizonEstimator, classify_return
from router.metrics import KvMetrics
from router.policy import Receipt, RouteRequest
from router.prefix_breaks import PrefixBreak, detect_break, pack_tokens, prompt_shape
from router.receipts import ReceiptCalibration, check_receipt
from router.replica_view import SessionTail
from router.session_table import SessionState, SessionTable

__all__ = ["SESSION_SOURCES", "SessionTracker"]

_log = logging.getLogger(__name__)

SESSION_SOURCES = frozenset({"session", "first_message"})
"""The ``AffinityKey`` sources that name a conversation (others hash a prompt)."""


class SessionTracker:
    """Sessions' turns, tails and finishes, and the receipts of every request."""

    def __init__(
        self,
        *,
        sessions: SessionTable,
        horizon: HorizonEstimator,
        calibration: ReceiptCalibration,
        metrics: KvMetrics | None,
        policy_name: str,
        detect_prefix_breaks: bool,
        receipt_large_abs_tokens: int,
        receipt_large_rel: float,
    ) -> None:
        self.sessions = sessions
        self._horizon = horizon
        self._returns: dict[ReplicaId, tuple[int, int]] = {}
        """Per replica: returns within its eviction horizon, and all classified returns."""
        self._footprint = (0, 0)
        """Session turns finished with a known size, and the blocks they released."""
        self._calibration = calibration
        self._metrics = metrics
        self._policy_name = policy_name
        self._detect_breaks = detect_prefix_breaks
        self._large_abs = receipt_large_abs_tokens
        self._large_rel = receipt_large_rel

    @staticmethod
    def session_of(akey: AffinityKey) -> str | None:
        """The session key, when the affinity key names a conversation."""
        return akey.key if akey.source in SESSION_SOURCES else None

    def previous(self, akey: AffinityKey) -> SessionState | None:
        """The session's last turn, if it names one the table remembers."""
        session = self.session_of(akey)
        return self.sessions.get(session) if session is not None else None

    def tail(
        self, previous: SessionState, now: float, held_blocks: int | None = None
    ) -> SessionTail:
        """The previous turn's blocks on its replica (consumed share, queue position).

        ``held_blocks``: the leading blocks of the new prompt the index shows on that
        replica.  More than the previous turn released there means a later turn this
        process did not route (another worker or router did) stored them: its record of
        when the run was last used is stale, and the run is taken as fresh (no share
        consumed) instead of aged from a turn that is no longer the latest."""
        if (held_blocks is not None and previous.blocks_mark is not None
                and held_blocks > previous.blocks_mark):
            return SessionTail(previous.replica, 0.0)
        consumed = self._tail_consumed(previous, now)
        if consumed > 0 and previous.free_mark and previous.blocks_mark:
            return SessionTail(previous.replica, consumed, previous.free_mark,
                               previous.blocks_mark)
        return SessionTail(previous.replica, consumed)

    def _tail_consumed(self, previous: SessionState, now: float) -> float:
        """Share of the free pool the session's replica allocated since its last turn
        finished: from the allocation count (exact under bursts), else from the time in
        horizons."""
        if previous.finished_at is None:
            return 0.0  # still running: its blocks are pinned
        if previous.alloc_mark is not None and previous.free_mark:
            used = self._horizon.allocated(previous.replica) - previous.alloc_mark
            return max(0.0, used) / previous.free_mark
        horizon = self._horizon.horizon_s(previous.replica, now)
        if horizon is None or math.isinf(horizon) or horizon <= 0:
            return 0.0
        return max(0.0, now - previous.finished_at) / horizon

    def reuse_share(self, replica: ReplicaId) -> float | None:
        """The chance that context cached on ``replica`` is reused before LRU evicts it:
        the share of conversations that came back to it within its eviction horizon
        (Laplace-smoothed); ``None`` before any return was classified."""
        within, total = self._returns.get(replica, (0, 0))
        return (within + 1) / (total + 2) if total else None

    def footprint_blocks(self) -> float | None:
        """The context a conversation holds in a replica's pool: the mean blocks a
        session's finished turn released (prompt and output; learnt online), ``None``
        before any was seen."""
        turns, blocks = self._footprint
        return blocks / turns if turns else None

    # ------------------------------------------------------------------ turns
    def turn(
        self,
        request: RouteRequest,
        akey: AffinityKey,
        replica: ReplicaId,
        prompt: Prompt | None,
        now: float,
    ) -> None:
        """A turn was routed to ``replica``: remember it; count stickiness, think time
        and any prefix break against the previous turn."""
        if akey.source not in SESSION_SOURCES:
            return
        m = self._metrics
        track = self._detect_breaks and akey.source == "session" and prompt is not None
        tokens, extends, last_key = b"", False, None
        if track and prompt is not None:
            tokens, extends = _packed(prompt, self.sessions.get(akey.key))
            last_key = _last_key(prompt)
        shape = prompt_shape(request.body) if track else None
        prev = self.sessions.turn(akey.key, replica, now, tokens, shape, last_key)
        if prev is None:
            return
        if prev.finished_at is not None:
            think = max(0.0, now - prev.finished_at)
            outcome = classify_return(think, self._horizon.horizon_s(prev.replica, now))
            if outcome != "unknown":
                within, total = self._returns.get(prev.replica, (0, 0))
                self._returns[prev.replica] = (within + (outcome == "within_horizon"), total + 1)
            if m is not None:
                m.think_time.labels().observe(think)
                m.session_returns.labels(prev.replica, outcome).inc()
        if m is not None:
            m.session_turns.labels(self._policy_name, "same_replica" if prev.replica == replica
                                   else "moved").inc()
        if (track and not extends and prev.tokens and prev.shape is not None
                and shape is not None):
            br = detect_break(prev.tokens, prev.shape, tokens, shape)
            if br is not None:
                self._prefix_break(request, br)

    def _prefix_break(self, request: RouteRequest, br: PrefixBreak) -> None:
        if self._metrics is not None:
            self._metrics.prefix_breaks.labels(br.cause).inc()
            self._metrics.prefix_break_lost_tokens.labels().inc(br.lost_tokens)
        _log.info(
            "prefix break in request %s: cause=%s at token %d of %d (message %s, "
            "role %s); %d cached tokens lost",
            request.request_id, br.cause, br.position, br.previous_tokens,
            br.message_index, br.message_role, br.lost_tokens,
        )

    def finished(
        self, session: str | None, replica: ReplicaId, released: int | None, now: float
    ) -> None:
        """A request finished on ``replica``, giving ``released`` blocks back (when
        known): close the session's turn and return the blocks to the pool estimate."""
        if session is not None and released is not None:
            turns, blocks = self._footprint
            self._footprint = (turns + 1, blocks + released)
        if session is not None:
            # The blocks ahead of this turn's in the LRU free queue: the free pool before
            # its own blocks return to it (they go behind).
            self.sessions.finished(
                session, replica, now,
                alloc_mark=self._horizon.allocated(replica),
                free_mark=self._horizon.free_blocks(replica, now),
                blocks_mark=released,
            )
        if released is not None:
            self._horizon.observe_released(replica, released)

    # ------------------------------------------------------------------ receipts
    def receipt(
        self,
        request: RouteRequest,
        predicted: int,
        index_predicted: int | None,
        receipt: Receipt,
    ) -> None:
        """Check the served request's report against ``predicted``; calibrate the
        replica's trust with ``index_predicted`` (the index's own prediction: ``None``
        when provisional entries extended it, whose shortfall in a burst is expected, or
        when another replica than the first choice served)."""
        check = check_receipt(
            receipt.replica, predicted, receipt.cached_tokens, receipt.prompt_tokens,
            large_abs_tokens=self._large_abs, large_rel=self._large_rel,
        )
        if index_predicted is not None:
            self._calibration.observe(receipt.replica, index_predicted, receipt.cached_tokens)
        m = self._metrics
        if m is None:
            return
        m.receipts.labels(receipt.replica, check.outcome).inc()
        if check.error is None or check.actual is None:
            return
        m.prediction_error.labels(receipt.replica).observe(check.error)
        if check.large:
            m.disagreements.labels(receipt.replica, check.outcome).inc()
            _log.info(
                "request %s: replica %s served %d cached tokens, predicted %d",
                request.request_id, receipt.replica, check.actual, check.predicted,
            )
        m.prompt_tokens.labels(receipt.replica, "cached").inc(check.actual)
        if receipt.prompt_tokens is not None:
            m.prompt_tokens.labels(receipt.replica, "computed").inc(
                max(0, receipt.prompt_tokens - check.actual))


def _packed(prompt: Prompt, previous: SessionState | None) -> tuple[bytes, bool]:
    """The prompt's tokens packed (``prefix_breaks.pack_tokens``), and whether they extend
    the session's previous prompt.

    A later turn usually extends its previous prompt: when the block key of the previous
    prompt's last full block is the new prompt's key at that block (the keys are chained,
    so every token before it is the same) and its partial block's tokens are the same,
    only the new tokens are packed.  Otherwise every token is (and compared by
    ``prefix_breaks.detect_break``)."""
    ids = prompt.token_ids
    if previous is None or not previous.tokens:
        return pack_tokens(ids), False
    old = previous.tokens
    n = len(old) // 4
    full = n // prompt.block_size
    keys = prompt.block_keys
    if (len(ids) >= n
            and (full == 0 or (previous.last_key is not None and len(keys) >= full
                               and keys[full - 1] == previous.last_key))
            and pack_tokens(ids[full * prompt.block_size:n]) == old[4 * full * prompt.block_size:]):
        return old + pack_tokens(ids[n:]), True
    return pack_tokens(ids), False


def _last_key(prompt: Prompt) -> RequestKey | None:
    """The key of the prompt's last full block, when it has one key per full block."""
    keys = prompt.block_keys
    if keys and len(keys) == len(prompt.token_ids) // prompt.block_size:
        return keys[-1]
    return None
