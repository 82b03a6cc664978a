"""What a decision does to the fleet after this request: the ``kv`` policy's look ahead.

The score (``router.scoring``) prices one request: its own prefill against the queues.
A placement also decides what the fleet's caches hold next, and whether the request can
start at all.  ``FleetOutlook.price`` adds four terms to each replica's score, all in
the score's unit (prefill tokens):

1. **Displaced context** (``router.displacement.displaced_blocks``): the blocks this
   request allocates on the replica (its prompt beyond the replica's expected hit, plus
   its expected reply) push the replica's paused conversations (``router.idle_runs``)
   toward eviction; what they would have found when they come back
   (``router.think_times``) and no longer will is charged.
2. **Retained context** (``displacement.retained_blocks``): what this conversation
   itself will find of its context when it comes back, if it runs there: a replica whose
   pool turns over slowly keeps it, one that churns does not.  Credited, when every
   candidate's free pool is known (a stale scrape must not decide between replicas).
3. **Pool headroom**: the replica's pool must hold the request with everything in
   flight there.  Running requests pin their blocks (prompt and reply, less the prefix
   every replica holds, which they share), so a request whose blocks do not fit waits
   until enough of them finish.  Each request in flight is expected to
   finish after the mean residual of the service times seen so far, given how long it
   has already run (``router.service_times``); taken soonest first, the wait is the
   time until the ones that finish free the shortfall.  So a replica whose long
   request is about to finish is told apart from one whose long request has just
   started.  That wait is charged at the prefill rate: the queue term counts prefill
   ahead, not the memory a long reply keeps pinned for seconds.
4. **The tail allowance**: a later turn whose replica holds its context is not charged
   the queue there up to the fleet's recent TTFT at quantile ``stay_quantile`` (learnt
   from receipts; 0.99, the tail that serving objectives and this project's
   comparisons state): a wait that keeps the request out of the tail is not worth its
   context's recomputation, and a move that saves it shortens the median at the cost of
   the cache and of whoever queues behind the recomputation on the target.  (At 0.9, a
   later turn left its context for waits that never reached the p99: on the Mooncake
   replay with the pool holding everything kv moved 0.8% of later turns and cached
   less than session affinity; at 0.99 it moves none.)

Terms 1 and 2 are forecasts of future hits, expected tokens of context kept or evicted;
``future_weight`` (1 by default: a token recomputed later costs what one computed now
does) weighs them against the request's own tokens.

Every input is learnt online from what the policy already sees (turns, receipts, the
horizon estimator's allocation counts and pool); nothing is known until it has been
seen, and an unknown term is zero.  Under ``kvroute serve --workers N``, and between
routers on one Redis index, each router also learns the others' requests and finishes
(``feed``, ``peer_routed``, ``peer_finished``; ``router.outlook_peers``), so every
router's terms are the whole fleet's.  Synchronous; times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvkeys.types import ReplicaId
from prompt.keyer import Prompt
from router.displacement import (
    GRID,
    displaced_blocks,
    displacement_curve,
    interpolate,
    retained_blocks,
)
from router.horizon import HorizonEstimator
from router.idle_runs import IdleRuns
from router.scoring import ReplicaScore
from router.service_times import ServiceTimes
from router.think_times import Returning, ThinkTimes

__all__ = ["FleetOutlook", "OutlookFeed", "OutlookSettings", "OutlookTerms"]

_EWMA = 0.05
"""Weight of the newest observation in the reply-size mean."""
_MIN_TTFT_SAMPLES = 20
_TTFT_SAMPLES = 512
"""Recent TTFTs kept for the tail allowance's quantile."""
_MAX_IN_FLIGHT = 65536
CURVE_REFRESH_S = 0.5
"""How long a replica's displacement curve is used before it is computed again."""


class OutlookFeed(Protocol):
    """The other router workers, told of this worker's requests as the look ahead learns
    them (``router.outlook_peers``), so each worker's look ahead sees the whole fleet's:
    the pins of every request in flight, every paused conversation, the service times,
    TTFTs and think times.  Times are durations, not timestamps: each worker receives
    them on its own clock.  Must not block."""

    def routed(self, request_id: str, session: str | None, replica: ReplicaId,
               blocks: float, think_s: float | None) -> None:
        """A request pinning ``blocks`` was sent to ``replica`` (``think_s``: its
        session's pause before it, if known)."""

    def finished(self, request_id: str, session: str | None, replica: ReplicaId,
                 released: int | None, ttft_s: float | None,
                 reply_tokens: int | None) -> None:
        """That request finished, giving ``released`` blocks back."""


@dataclass(frozen=True, slots=True)
class OutlookSettings:
    """The look ahead's settings (``ScoringSettings``)."""

    future_weight: float = 1.0
    """Weight of a forecast future hit (terms 1 and 2) against a token computed now."""
    stay_quantile: float | None = 0.99
    """TTFT quantile up to which a later turn's own replica is not charged its queue
    (``None``: off): the tail the policy keeps requests out of, p99."""
    pool_headroom: bool = True
    """Charge the wait for pool space (term 3)."""


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class OutlookTerms:
    """The look ahead's forecasts for one candidate of the latest decision (what
    ``price`` added to its score, before weighing): for ``/debug/route`` and the
    ``router_kv_outlook_*`` series."""

    displaced_tokens: float
    """Term 1: returning conversations' tokens the placement is expected to evict."""
    retained_tokens: float
    """Term 2: this conversation's tokens expected to survive to its next turn."""
    pool_wait_s: float
    """Term 3: seconds until the pool holds the request beside those in flight."""


@dataclass(slots=True)
class _Pinned:
    blocks: float = 0.0
    sent: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Request id -> (blocks pinned, when it was sent)."""


class FleetOutlook:
    """The look ahead's learnt state and its pricing (module docstring)."""

    def __init__(
        self, horizon: HorizonEstimator, settings: OutlookSettings = OutlookSettings(),
        *, prefill_tokens_per_s: float, alpha: float, beta: float,
        idle_runs: IdleRuns | None = None, feed: OutlookFeed | None = None,
    ) -> None:
        self.settings = settings
        self.feed = feed
        """Where this router's requests and finishes are told to the other workers."""
        self.think_times = ThinkTimes()
        self.idle_runs = idle_runs if idle_runs is not None else IdleRuns()
        self._horizon = horizon
        self._rate = prefill_tokens_per_s
        self._alpha = alpha
        self._beta = beta
        self._reply_tokens: float | None = None
        self._service = ServiceTimes()
        self._pinned: dict[ReplicaId, _Pinned] = {}
        self._in_flight: OrderedDict[str, tuple[ReplicaId, float, float]] = OrderedDict()
        self._ttfts: deque[float] = deque(maxlen=_TTFT_SAMPLES)
        self._ttft_q: float | None = None
        self._ttft_seen = 0
        self._ttft_at = 0
        self._curves: dict[ReplicaId, tuple[float, tuple[float, ...]]] = {}
        self.last: dict[ReplicaId, OutlookTerms] = {}
        """The terms of every candidate of the latest ``price`` call."""

    # ------------------------------------------------------------------ learning
    def routed(
        self, request_id: str, session: str | None, replica: ReplicaId, prompt: Prompt,
        scores: Sequence[ReplicaScore], paused_at: float | None, now: float,
    ) -> None:
        """A request was sent to ``replica`` (``scores``: every candidate's), pinning its
        blocks there; a session's turn ends its pause (``paused_at``: when its previous
        turn finished, if known).  Told to the peers (``feed``)."""
        shared = min((s.expected_cached_tokens for s in scores), default=0.0)
        blocks = self.pinned_blocks(prompt.num_tokens, shared, prompt.block_size)
        think_s = max(0.0, now - paused_at) if paused_at is not None else None
        self._routed(request_id, session, replica, blocks, think_s, now)
        if self.feed is not None:
            self.feed.routed(request_id, session, replica, blocks, think_s)

    def peer_routed(
        self, request_id: str, session: str | None, replica: ReplicaId, blocks: float,
        think_s: float | None, now: float,
    ) -> None:
        """Another worker routed a request (``OutlookFeed.routed``), received ``now``."""
        self._routed(request_id, session, replica, blocks, think_s, now)

    def _routed(
        self, request_id: str, session: str | None, replica: ReplicaId, blocks: float,
        think_s: float | None, now: float,
    ) -> None:
        if session is not None:
            self.idle_runs.resumed(session)
            if think_s is not None:
                self.think_times.returned(think_s, now)
        pinned = self._pinned.setdefault(replica, _Pinned())
        pinned.blocks += blocks
        pinned.sent[request_id] = (blocks, now)
        self._in_flight[request_id] = (replica, blocks, now)
        while len(self._in_flight) > _MAX_IN_FLIGHT:
            rid, (r, b, _t) = self._in_flight.popitem(last=False)
            self._unpin(r, rid, b)

    def finished(
        self, request_id: str, session: str | None, replica: ReplicaId,
        released: int | None, ttft_s: float | None, reply_tokens: int | None, now: float,
    ) -> None:
        """The request finished on ``replica``: unpin it, learn its service time, TTFT
        and reply size, and start its session's pause.  Told to the peers (``feed``)."""
        self._finished(request_id, session, replica, released, ttft_s, reply_tokens, now)
        if self.feed is not None:
            self.feed.finished(request_id, session, replica, released, ttft_s, reply_tokens)

    def peer_finished(
        self, request_id: str, session: str | None, replica: ReplicaId,
        released: int | None, ttft_s: float | None, reply_tokens: int | None, now: float,
    ) -> None:
        """A request another worker routed finished (``OutlookFeed.finished``), received
        ``now``: as ``finished``, and its blocks return to the free pool estimate (the
        session tracker does that for this worker's own)."""
        if released:
            self._horizon.observe_released(replica, released)
        self._finished(request_id, session, replica, released, ttft_s, reply_tokens, now)

    def peer_forgot(self, request_id: str) -> None:
        """Another worker's request is no longer in flight there, though its finish
        never arrived: drop its pins, learn nothing from it."""
        sent = self._in_flight.pop(request_id, None)
        if sent is not None:
            self._unpin(sent[0], request_id, sent[1])

    def _finished(
        self, request_id: str, session: str | None, replica: ReplicaId,
        released: int | None, ttft_s: float | None, reply_tokens: int | None, now: float,
    ) -> None:
        sent = self._in_flight.pop(request_id, None)
        if sent is not None:
            self._unpin(sent[0], request_id, sent[1])
            self._service.observe(now - sent[2])
        if ttft_s is not None:
            self._ttfts.append(ttft_s)
            self._ttft_seen += 1
        if reply_tokens:
            self._reply_tokens = _ewma(self._reply_tokens, float(reply_tokens))
        if session is None:
            return
        self.think_times.paused(now)
        free = self._horizon.free_blocks(replica, now)
        if released and free is not None:
            self.idle_runs.paused(session, replica, alloc_mark=self._horizon.allocated(replica),
                                  free_mark=free, blocks=released, now=now)

    def forget(self, replica: ReplicaId) -> None:
        """The replica left or restarted."""
        self.idle_runs.forget_replica(replica)
        self._pinned.pop(replica, None)
        self._curves.pop(replica, None)

    def _unpin(self, replica: ReplicaId, request_id: str, blocks: float) -> None:
        pinned = self._pinned.get(replica)
        if pinned is not None and pinned.sent.pop(request_id, None) is not None:
            pinned.blocks = max(0.0, pinned.blocks - blocks)

    def pinned_blocks(self, prompt_tokens: int, shared_tokens: float, block_size: int) -> float:
        """The blocks a request pins beyond the prefix every replica holds: its prompt
        and expected reply."""
        total = -(-(prompt_tokens + int(self._reply_tokens or 0)) // block_size)
        return max(0.0, total - shared_tokens // block_size)

    # ------------------------------------------------------------------ pricing
    def price(
        self,
        ranked: Sequence[ReplicaScore],
        prompt: Prompt,
        session: str | None,
        home: ReplicaId | None,
        now: float,
    ) -> list[ReplicaScore]:
        """``ranked`` with the look ahead's terms (module docstring), best first (ties
        keep their order).  ``home``: a later turn's previous replica."""
        prompt_tokens, block_size = prompt.num_tokens, prompt.block_size
        self.last = {}
        if not ranked or block_size <= 0:
            return list(ranked)
        share = self.think_times.return_share(now)
        fresh = self.think_times.returning(0.0, share)

        def outlook(elapsed: float) -> Returning | None:
            return self.think_times.returning(elapsed, share)

        shared = min(s.expected_cached_tokens for s in ranked)
        need = self.pinned_blocks(prompt_tokens, shared, block_size)
        reply_blocks = (self._reply_tokens or 0.0) / block_size
        w = self.settings.future_weight * self._alpha * block_size
        allowance = self._allowance() if home is not None else 0.0
        # Term 2 compares replicas: credited only when every candidate's pool is known
        # (a replica whose scrape is stale must not lose to one whose is fresh).
        frees = {s.replica: self._horizon.free_blocks(s.replica, now) for s in ranked}
        retain = session is not None and None not in frees.values()
        out = []
        terms: dict[ReplicaId, OutlookTerms] = {}
        for s in ranked:
            r = s.replica
            rate = self._horizon.allocation_rate(r) or 0.0
            adjust = 0.0
            lost = kept = wait = 0.0
            if share is not None and w > 0:
                allocate = max(0.0, (prompt_tokens - s.expected_cached_tokens) / block_size)
                allocate += reply_blocks
                lost = self._displaced(r, allocate, rate, session, outlook, now)
                free = frees[r]
                if retain and free is not None:
                    kept = retained_blocks(prompt_tokens / block_size + reply_blocks, free,
                                           rate, fresh)
                adjust += w * (kept - lost)
            if self.settings.pool_headroom:
                wait = self._pool_wait_s(r, need, shared // block_size, now)
                adjust -= self._rate * wait
            if r == home and s.expected_cached_tokens > shared:
                adjust += self._beta * min(s.queued_prefill_tokens, allowance)
            terms[r] = OutlookTerms(lost * block_size, kept * block_size, wait)
            out.append(s.rescored(s.score + adjust) if adjust else s)
        self.last = terms
        out.sort(key=lambda s: -s.score)
        return out

    def _displaced(
        self, replica: ReplicaId, allocate: float, rate: float, session: str | None,
        outlook: Callable[[float], Returning | None], now: float,
    ) -> float:
        """Term 1 from the replica's displacement curve (recomputed at most every
        ``CURVE_REFRESH_S``: a forecast, not a count), less the request's own run,
        which its turn re-uses rather than loses."""
        allocated = self._horizon.allocated(replica)
        cached = self._curves.get(replica)
        if cached is None or now - cached[0] >= CURVE_REFRESH_S or now < cached[0]:
            curve = displacement_curve(self.idle_runs.runs(replica, allocated, now), rate,
                                       outlook)
            cached = self._curves[replica] = (now, curve)
        lost = interpolate(GRID, cached[1], allocate)
        if session is not None and self.idle_runs.replica_of(session) == replica:
            own = self.idle_runs.run_of(session, allocated, now)
            if own is not None:
                lost -= displaced_blocks([own], allocate, rate, outlook)
        return max(0.0, lost)

    def _pool_wait_s(
        self, replica: ReplicaId, need: float, shared_blocks: float, now: float
    ) -> float:
        """Seconds until the replica's pool holds ``need`` more blocks (term 3)."""
        pool = self._horizon.pool_blocks(replica)
        pinned = self._pinned.get(replica)
        if pool is None or pinned is None or not pinned.sent or not self._service:
            return 0.0
        short = pinned.blocks + need + shared_blocks - pool
        if short <= 0:
            return 0.0
        remaining = self._service.remaining
        finishing = sorted((remaining(now - t) or 0.0, b) for b, t in pinned.sent.values())
        freed = 0.0
        for left, blocks in finishing:
            freed += blocks
            if freed >= short:
                return left
        return finishing[-1][0]

    def _allowance(self) -> float:
        """The queue, in tokens, a later turn's own replica is not charged (term 4)."""
        q = self.settings.stay_quantile
        if q is None or len(self._ttfts) < _MIN_TTFT_SAMPLES:
            return 0.0
        if self._ttft_q is None or self._ttft_seen - self._ttft_at >= 32:
            self._ttft_at = self._ttft_seen
            ordered = sorted(self._ttfts)
            self._ttft_q = ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]
        return self._ttft_q * self._rate


def _ewma(old: float | None, x: float) -> float:
    return x if old is None else old + _EWMA * (x - old)
