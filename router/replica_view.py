"""The replicas as the ``kv`` policy's scoring sees them: one ``ReplicaInput`` each.

Per replica it merges what the router knows from four sources:

* **load**: the load tracker's own accounting (queued prefill, decoding), with the part
  this policy sent capped by a fluid estimate of what a replica prefilling at the
  configured rate would still have queued (non-streaming requests keep the tracker's
  count raised until the whole answer arrives), plus the foreign load a scrape shows
  beyond our own requests at scrape time (``scoring.foreign_load``);
* **freshness**: the event source's state (lag, disconnection, recent gaps and resets)
  and the receipt calibration's trust;
* **pool**: the eviction horizon and free pool (``router.horizon``) and, for the
  session's previous replica, its tail (``SessionTail``: how much of the pool has been
  allocated since the session's last turn finished);
* **placements**: the decaying count of new conversations recently placed (only for a
  new conversation).

The view keeps the state those need between requests (what we sent, where we placed,
our load at each scrape, when gap and resync counters moved) and the last load terms
and trust per replica for the scrape-time gauges.  It does not score, pick or know about
sessions beyond the tail it is handed.  Synchronous methods only; times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from index.status import SourceStatus
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId
from router.horizon import HorizonEstimator
from router.load import LoadTracker
from router.receipts import ReceiptCalibration
from router.scoring import (
    CostModel,
    Freshness,
    LoadTerms,
    ReplicaInput,
    ScoringWeights,
    combine_load,
    foreign_load,
    index_trust,
)
from router.scrape import Scrapes, ScrapeSample

__all__ = ["ReplicaView", "SessionTail"]

_NO_HIT = ReplicaHit()


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class SessionTail:
    """The previous turn's blocks on the replica it went to (``scoring.ReplicaInput``'s
    ``tail_*`` fields)."""

    replica: ReplicaId
    consumed: float = 0.0
    """Share of the free pool allocated since the turn finished."""
    queue_blocks: float | None = None
    """Free blocks ahead of the turn's blocks in the LRU queue when it finished."""
    run_blocks: int = 0
    """Blocks the turn released (its run)."""


class _FreshnessTracker:
    """Turns event-source snapshots into ``Freshness`` inputs, remembering when gap and
    resync counters last moved (the snapshot only carries counts)."""

    def __init__(self, statuses: Callable[[ReplicaId], SourceStatus | None]) -> None:
        self._statuses = statuses
        self._seen: dict[ReplicaId, tuple[int, int, float | None, float | None]] = {}

    def forget(self, replica: ReplicaId) -> None:
        """Drop the remembered counters of ``replica``."""
        self._seen.pop(replica, None)

    def get(
        self, replica: ReplicaId, now: float, wall: float, trust: float
    ) -> tuple[Freshness, bool]:
        """The freshness inputs, and whether the replica's event source is live."""
        status = self._statuses(replica)
        if status is None:
            return Freshness(receipt_trust=trust), False
        # Counters at first sight are the baseline: the initial sync of a source is not
        # a reason to distrust it (and the source does not count it as a resync).
        gaps, resyncs, gap_t, reset_t = self._seen.get(
            replica, (status.gaps, status.resyncs, None, None))
        if status.gaps > gaps:
            gap_t = now
        if status.resyncs > resyncs:
            reset_t = now
        self._seen[replica] = (status.gaps, status.resyncs, gap_t, reset_t)
        connected = status.connected and status.state in ("live", "resyncing", "standby")
        if connected:
            lag = status.receive_lag_s or 0.0
        elif status.last_receive_wall is not None:
            lag = max(0.0, wall - status.last_receive_wall)
        else:
            lag = 0.0
        fresh = Freshness(
            lag_s=max(0.0, lag),
            connected=connected,
            since_gap_s=None if gap_t is None else now - gap_t,
            since_reset_s=None if reset_t is None else now - reset_t,
            receipt_trust=trust,
        )
        return fresh, connected and status.state == "live"


class ReplicaView:
    """Per-replica scoring inputs, and the accounting of what this policy sent."""

    def __init__(
        self,
        *,
        load: LoadTracker,
        horizon: HorizonEstimator,
        calibration: ReceiptCalibration,
        statuses: Callable[[ReplicaId], SourceStatus | None],
        scraper: Scrapes | None,
        weights: ScoringWeights,
        costs: CostModel,
        foreign_prefill_tokens_per_request: float,
        placement_tau_s: float,
    ) -> None:
        self._load = load
        self._horizon = horizon
        self._calibration = calibration
        self._freshness = _FreshnessTracker(statuses)
        self._scraper = scraper
        self._weights = weights
        self._costs = costs
        self._foreign_per_request = foreign_prefill_tokens_per_request
        self._placement_tau_s = placement_tau_s
        self._last_terms: dict[ReplicaId, tuple[LoadTerms, Freshness]] = {}
        """The load terms and freshness each replica was last scored with (its index
        trust is computed for the gauges when they are read)."""
        self._placed: dict[ReplicaId, tuple[float, float]] = {}
        """New conversations placed (decaying value, when last updated)."""
        self._own_at_scrape: dict[ReplicaId, tuple[float, int, int]] = {}
        """Our queued and in-flight requests at each replica's latest scrape."""
        self._fluid: dict[ReplicaId, tuple[float, float]] = {}
        """Fluid prefill queue of what we sent (tokens, when last updated)."""
        self._sent_prefill: dict[ReplicaId, int] = {}
        """Prefill tokens of this policy's requests in flight, per replica (a part of
        what the load tracker counts)."""
        if scraper is not None:
            scraper.add_listener(self.on_scrape)

    def on_scrape(self, replica: ReplicaId, sample: ScrapeSample) -> None:
        """Scrape listener: remember our own load on ``replica`` at the scrape, so the
        foreign part of its gauges can be told apart later (``scoring.foreign_load``)."""
        own = self._load.get(replica)
        self._own_at_scrape[replica] = (sample.t, own.in_flight - own.decoding, own.in_flight)

    # ------------------------------------------------------------------ inputs
    def inputs(
        self,
        candidates: Sequence[ReplicaId],
        hits: PrefixHits,
        now: float,
        wall: float,
        *,
        tail: SessionTail | None,
        new_conversation: bool,
    ) -> tuple[list[ReplicaInput], bool]:
        """Scoring inputs per candidate, and whether every candidate's event source is
        live (a no-hit from a sighted index means "new prefix", not "unknown")."""
        by_replica = hits.by_replica
        runs = sorted((h.blocks for h in by_replica.values()), reverse=True)
        second = runs[1] if len(runs) > 1 else 0
        inputs = []
        sighted = True
        for r in candidates:
            terms = self._load_terms(r, now, new_conversation)
            fresh, live = self._freshness.get(r, now, wall, self._calibration.trust(r))
            sighted = sighted and live
            hit = by_replica.get(r, _NO_HIT)
            mine = tail if tail is not None and tail.replica == r else None
            inputs.append(ReplicaInput(
                replica=r,
                hit=hit,
                load=terms,
                freshness=fresh,
                horizon_s=self._horizon.horizon_s(r, now),
                free_blocks=self._horizon.free_blocks(r, now),
                tail_consumed=mine.consumed if mine is not None else 0.0,
                tail_queue_blocks=mine.queue_blocks if mine is not None else None,
                tail_run_blocks=mine.run_blocks if mine is not None else 0,
                hot_blocks=min(hit.blocks, second),
                costs=self._costs,
            ))
            self._last_terms[r] = (terms, fresh)
        return inputs, sighted

    def _load_terms(self, r: ReplicaId, now: float, new_conversation: bool) -> LoadTerms:
        own = self._load.get(r)
        sample = self._scraper.latest(r, now) if self._scraper is not None else None
        f_wait: float | None = None
        f_run: float | None = None
        age_s = 0.0
        if sample is not None:
            then = self._own_at_scrape.get(r)
            queued_then, in_flight_then = (0, 0)
            if then is not None and then[0] == sample.t:
                queued_then, in_flight_then = then[1], then[2]
            f_wait, f_run = foreign_load(
                scraped_waiting=sample.waiting, scraped_running=sample.running,
                own_queued_then=queued_then, own_in_flight_then=in_flight_then,
            )
            age_s = max(0.0, now - sample.t)
        # The tracker's queued prefill, except that the part this policy sent is capped
        # by the fluid estimate (see ``_fluid_queue``).
        mine = min(own.queued_prefill_tokens, self._sent_prefill.get(r, 0))
        queued_own = own.queued_prefill_tokens - mine + min(mine, self._fluid_queue(r, now))
        return combine_load(
            own_queued_prefill_tokens=queued_own,
            own_decoding=own.decoding,
            foreign_waiting=f_wait,
            foreign_running=f_run,
            foreign_prefill_tokens_per_request=self._foreign_per_request,
            scrape_age_s=age_s,
            prefill_tokens_per_s=self._costs.prefill_tokens_per_s,
            placements=self._placements(r, now) if new_conversation else 0.0,
        )

    # ------------------------------------------------------------------ accounting
    def sent(
        self, replica: ReplicaId, prefill_tokens: int, now: float, *, new_conversation: bool
    ) -> None:
        """A request was routed to ``replica``, charged ``prefill_tokens``."""
        if prefill_tokens:
            self._fluid[replica] = (self._fluid_queue(replica, now) + prefill_tokens, now)
            self._sent_prefill[replica] = self._sent_prefill.get(replica, 0) + prefill_tokens
        if new_conversation:
            self._placed[replica] = (self._placements(replica, now) + 1.0, now)

    def forget(self, replica: ReplicaId) -> None:
        """Drop what was learnt of ``replica`` (it left, joined anew or restarted); the
        prefill of requests still in flight there stays counted until they finish."""
        self._last_terms.pop(replica, None)
        self._placed.pop(replica, None)
        self._own_at_scrape.pop(replica, None)
        self._fluid.pop(replica, None)
        self._freshness.forget(replica)

    def finished(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """A request routed to ``replica`` with ``prefill_tokens`` finished."""
        if not prefill_tokens:
            return
        left = self._sent_prefill.get(replica, 0) - prefill_tokens
        if left > 0:
            self._sent_prefill[replica] = left
        else:
            self._sent_prefill.pop(replica, None)

    def _fluid_queue(self, replica: ReplicaId, now: float) -> float:
        """Prefill tokens this policy sent to ``replica`` that a replica prefilling at
        ``prefill_tokens_per_s`` would not have finished yet (a fluid FIFO queue).

        It caps the load tracker's queued prefill, which for non-streaming requests
        stays raised until the whole answer arrives (vLLM sends nothing before), long
        after the prefill ended."""
        queued, since = self._fluid.get(replica, (0.0, now))
        return max(0.0, queued - self._costs.prefill_tokens_per_s * (now - since))

    def _placements(self, replica: ReplicaId, now: float) -> float:
        """New conversations recently placed on ``replica`` (decaying, tau
        ``placement_tau_s``)."""
        value, since = self._placed.get(replica, (0.0, now))
        if value == 0.0:
            return 0.0
        return value * math.exp(-(now - since) / self._placement_tau_s)

    # ------------------------------------------------------------------ gauges
    def gauge_rows(self, now: float) -> Iterator[tuple[str, str, float]]:
        """Scrape-time gauge rows (horizon, rate, the load terms and trust used last)."""
        for r, (terms, fresh) in list(self._last_terms.items()):
            h = self._horizon.horizon_s(r, now)
            if h is not None:
                yield ("router_eviction_horizon_seconds", r, h)
            rate = self._horizon.allocation_rate(r)
            if rate is not None:
                yield ("router_kv_allocation_blocks_per_second", r, rate)
            yield ("router_kv_load_queued_prefill_tokens", r, terms.queued_prefill_tokens)
            yield ("router_kv_load_decode", r, terms.decode_load)
            yield ("router_kv_index_trust", r, index_trust(fresh, self._weights))
