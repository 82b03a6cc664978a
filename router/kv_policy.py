"""The ``kv`` policy: route each request where its prompt's KV cache most likely is,
unless the queue there costs more than the cache saves.

Algorithm, per request (``KvPolicy.decide``):

1. **Render and hash** (``index`` renderers, incremental per conversation): the prompt's
   token ids and chained block keys (``cache_salt`` folded into block 0, the LoRA name
   into every block, exactly as vLLM hashes), so tenants never match each other's
   blocks.  A request that cannot be rendered (unknown model, media, a replica that
   cannot tokenize) skips to step 6.
2. **Index lookup**: per candidate replica, the run of leading blocks it holds, per tier
   (GPU, CPU offload, storage).  ``IndexUnavailable`` (Redis down) skips to step 6.
   The lookup is extended by **provisional entries** (``router.provisional``): the
   blocks of requests routed in the last ``provisional_ttl_s`` whose ``BlockStored``
   events have not arrived yet, so a burst sharing a new prefix goes together.
3. **Load snapshot** per replica: the router's own accounting (queued prefill tokens
   until the first byte, then decoding) merged with the replica's scraped ``/metrics``
   (waiting, running; a stale scrape is unknown, not zero), the index freshness for that
   replica (event lag, disconnection, recent gaps and resets, receipt calibration), its
   eviction horizon and free pool (``router.horizon``: the scrape carried forward by the
   blocks this policy's requests release and the events' allocations) and,
   for the session's previous
   replica, how much of its free pool has been allocated since the session's last turn
   finished (LRU: its idle blocks are evicted once that share reaches one).
4. **Pure scoring** (``router.scoring``): ``score = -alpha * new_tokens - beta *
   queued_prefill_tokens - gamma * decode_load - delta * placements`` where
   ``new_tokens`` is the prompt minus the *expected* cached tokens: a sum over usable
   matched blocks (last prompt token always recomputed) of P(hit) x tier value.  Blocks
   a second replica also holds (a popular prefix) count as hot.  ``placements`` (new
   conversations only) is the decaying count of new conversations recently placed on
   the replica: future load the queue does not show yet under paced traffic.
5. **Pick**: the best score; exact ties go by the request's consistent-hash ring order,
   so equal replicas (all holding a shared system prompt, no load) still spread new
   conversations.  A popular prefix whose holder is overloaded is computed on a second
   replica when the holder's queue outweighs the prefix: replication emerges from the
   queue term (reason ``kv_load``).
6. **Fallback: session affinity** (``router.affinity``) when the index has nothing
   useful: it is down, the prompt could not be rendered, or the best expected hit is
   below ``min_hit_tokens`` while some candidate's event source is not live (the index
   may simply not know where the session is).  A session seen before stays on the
   replica of its previous turn (wherever that was decided); otherwise the ring
   (uhashring, ketama) pins the session key (header, ``user``, first message, or prompt
   prefix); a pinned replica
   whose load exceeds the least loaded by ``balance_abs_tokens`` and ``balance_rel``x
   yields to the least loaded (reason ``affinity_overload``).  When every candidate's
   event source is live, a miss means a genuinely new prefix: it is placed by the same
   score (load and recent placements, ties by ring order; reason ``kv_new``), and its
   later turns follow it through the index.

Then (``commit``; not for ``/debug/route``): record provisional entries, update the
session (stickiness counter, think time against the eviction horizon, prefix-break
check), and count predictions.  ``record`` checks the receipt: the reported
``cached_tokens`` against ``Decision.predicted_cached_tokens`` (histogram of the error
per replica, counter of large disagreements), and feeds the per-replica calibration.

``Decision.prompt_tokens`` is what the proxy charges the replica's queue for this
request (``LoadTracker.lease``): the tokens it must *prefill*, i.e. the prompt minus the
predicted cached tokens.  The full prompt length is in ``detail["prompt_tokens"]``.

Reasons (bounded label values): ``kv_hit`` (the chosen replica has the best expected
hit), ``kv_load`` (load outweighed a better hit elsewhere), ``kv_new`` (no hit anywhere,
placed by load), ``affinity_no_hit``,
``affinity_index_down``, ``affinity_no_prompt``, ``affinity_overload``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from index.status import SourceStatus
from index.store import IndexUnavailable, KVIndex
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId
from prompt.keyer import Prompt
from router.affinity import AffinityKey, AffinityRing, affinity_key
from router.horizon import HorizonEstimator, classify_return
from router.load import LoadTracker
from router.metrics import KvMetrics
from router.policy import Decision, Receipt, RouteRequest
from router.prefix_breaks import detect_break, pack_tokens, prompt_shape
from router.provisional import ProvisionalBlocks
from router.receipts import ReceiptCalibration, check_receipt
from router.scoring import (
    CostModel,
    Freshness,
    LoadTerms,
    ReplicaInput,
    ReplicaScore,
    ScoringWeights,
    combine_load,
    foreign_load,
    index_trust,
    pick,
    rank_replicas,
)
from router.scrape import MetricsScraper, ScrapeSample
from router.session_table import SessionState, SessionTable

__all__ = ["KvConfig", "KvPolicy", "PromptSource"]

_log = logging.getLogger(__name__)

_EMPTY = PrefixHits()
_NO_HIT = ReplicaHit()
_SESSION_SOURCES = frozenset({"session", "first_message"})


class PromptSource(Protocol):
    """Renders a request into the prompt the engine will see (``index`` renderers)."""

    async def prompt(self, request: RouteRequest, replica_url: str | None) -> Prompt | None:
        """The prompt, or ``None`` when it cannot be known exactly (never raises for a
        request the replica might still accept)."""
        ...


@dataclass(frozen=True, slots=True)
class KvConfig:
    """The numbers the policy copies from ``ScoringSettings`` at construction."""

    weights: ScoringWeights = ScoringWeights()
    costs: CostModel = CostModel()
    min_hit_tokens: int = 64
    temperature: float = 0.0
    foreign_prefill_tokens_per_request: float = 512.0
    balance_abs_tokens: float = 4096.0
    balance_rel: float = 2.0
    placement_tau_s: float = 300.0
    affinity_prefix_blocks: int = 8
    detect_prefix_breaks: bool = True
    receipt_large_abs_tokens: int = 64
    receipt_large_rel: float = 0.1


class _Freshness:
    """Turns event-source snapshots into ``Freshness`` inputs, remembering when gap and
    resync counters last moved (the snapshot only carries counts)."""

    def __init__(self, statuses: Callable[[ReplicaId], SourceStatus | None]) -> None:
        self._statuses = statuses
        self._seen: dict[ReplicaId, tuple[int, int, float | None, float | None]] = {}

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


class KvPolicy:
    """The ``kv`` policy (see the module docstring)."""

    name = "kv"

    def __init__(
        self,
        *,
        prompts: PromptSource,
        index: KVIndex | None,
        load: LoadTracker,
        replica_url: Callable[[ReplicaId], str | None],
        statuses: Callable[[ReplicaId], SourceStatus | None] = lambda r: None,
        scraper: MetricsScraper | None = None,
        horizon: HorizonEstimator | None = None,
        metrics: KvMetrics | None = None,
        config: KvConfig = KvConfig(),
        ring: AffinityRing | None = None,
        provisional: ProvisionalBlocks | None = None,
        sessions: SessionTable | None = None,
        calibration: ReceiptCalibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self._prompts = prompts
        self._index = index
        self._load = load
        self._replica_url = replica_url
        self._scraper = scraper
        self.horizon = horizon if horizon is not None else HorizonEstimator()
        self._metrics = metrics
        self.config = config
        self.ring = ring if ring is not None else AffinityRing()
        self.provisional = provisional if provisional is not None else ProvisionalBlocks()
        self.sessions = sessions if sessions is not None else SessionTable()
        self.calibration = calibration if calibration is not None else ReceiptCalibration()
        self._freshness = _Freshness(statuses)
        self._clock = clock
        self._wall = wall
        self._rng = rng if rng is not None else random.Random()
        self._last_terms: dict[ReplicaId, tuple[LoadTerms, float]] = {}
        self._placed: dict[ReplicaId, tuple[float, float]] = {}
        self._own_at_scrape: dict[ReplicaId, tuple[float, int, int]] = {}
        self._fluid: dict[ReplicaId, tuple[float, float]] = {}
        self._mine: dict[ReplicaId, int] = {}
        """Prefill tokens of this policy's requests in flight, per replica (a part of
        what the load tracker counts)."""
        if scraper is not None:
            scraper.add_listener(self.on_scrape)
        if metrics is not None:
            self._route_hist = metrics.route_seconds.labels(self.name)
            self._stage = {s: metrics.stage_seconds.labels(s)
                           for s in ("render", "lookup", "score")}

    def on_scrape(self, replica: ReplicaId, sample: ScrapeSample) -> None:
        """Scrape listener: remember our own load on ``replica`` at the scrape, so the
        foreign part of its gauges can be told apart later (``scoring.foreign_load``)."""
        own = self._load.get(replica)
        self._own_at_scrape[replica] = (sample.t, own.in_flight - own.decoding, own.in_flight)

    # ------------------------------------------------------------------ Policy
    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """Decide and commit (provisional entries, session bookkeeping, counters)."""
        return await self.decide(request, candidates, commit=True)

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Check the receipt against the prediction; close the session's turn."""
        now = self._clock()
        if decision.prompt_tokens:
            left = self._mine.get(decision.replica, 0) - decision.prompt_tokens
            if left > 0:
                self._mine[decision.replica] = left
            else:
                self._mine.pop(decision.replica, None)
        detail = decision.detail
        session = detail.get("session")
        released = self._released_blocks(decision, receipt)
        if isinstance(session, str):
            # The blocks ahead of this turn's in the LRU free queue: the free pool before
            # its own blocks return to it (they go behind).
            self.sessions.finished(
                session, receipt.replica, now,
                alloc_mark=self.horizon.allocated(receipt.replica),
                free_mark=self.horizon.free_blocks(receipt.replica, now),
                blocks_mark=released,
            )
        if released is not None:
            self.horizon.observe_released(receipt.replica, released)
        predicted = decision.predicted_cached_tokens
        if predicted is None or not receipt.ok or receipt.replica != decision.replica:
            return
        check = check_receipt(
            receipt.replica, predicted, receipt.cached_tokens, receipt.prompt_tokens,
            large_abs_tokens=self.config.receipt_large_abs_tokens,
            large_rel=self.config.receipt_large_rel,
        )
        index_predicted = detail.get("index_predicted_cached_tokens", predicted)
        if isinstance(index_predicted, int):
            self.calibration.observe(receipt.replica, index_predicted, receipt.cached_tokens)
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

    # ------------------------------------------------------------------ pipeline
    async def decide(
        self, request: RouteRequest, candidates: Sequence[ReplicaId], *, commit: bool
    ) -> Decision:
        """The decision for ``request``; ``commit=False`` changes no state (debug)."""
        t0 = time.perf_counter()
        now = self._clock()
        m = self._metrics

        prompt = await self._render(request, candidates)
        t_render = time.perf_counter()
        keys = prompt.block_keys if prompt is not None else ()
        akey = affinity_key(request, keys, prefix_blocks=self.config.affinity_prefix_blocks)
        previous = self.sessions.get(akey.key) if akey.source in _SESSION_SOURCES else None

        hits: PrefixHits | None = None
        fallback: str | None = None
        if prompt is None:
            fallback = "no_prompt"
        elif self._index is None:
            fallback = "index_down"
        else:
            try:
                hits = await self._index.lookup(keys, among=candidates)
            except IndexUnavailable as exc:
                _log.debug("index unavailable for %s: %s", request.request_id, exc)
                fallback = "index_down"
        t_lookup = time.perf_counter()
        real = hits
        if hits is not None:
            hits = self.provisional.overlay(hits, keys, now, candidates)

        new_conversation = previous is None
        inputs, sighted = self._inputs(candidates, hits or _EMPTY, now, previous,
                                       new_conversation)
        n_tokens = prompt.num_tokens if prompt is not None else 0
        block_size = prompt.block_size if prompt is not None else 1
        ranked = rank_replicas(inputs, n_tokens, block_size, self.config.weights)
        preference = self.ring.preference(akey.key, candidates)
        best_expected = max(s.expected_cached_tokens for s in ranked)

        ordered: list[ReplicaScore]
        no_hit = fallback is None and best_expected < self.config.min_hit_tokens
        if no_hit and not sighted:
            # The index may just not know: keep sessions where the ring pins them.
            fallback = "no_hit"
        if fallback is None:
            u = self._rng.random() if self.config.temperature > 0 else 0.0
            ordered = pick(ranked, preference=preference,
                           temperature=self.config.temperature, u=u)
            chosen = ordered[0]
            if no_hit:
                reason = "kv_new"
            elif chosen.expected_cached_tokens >= best_expected:
                reason = "kv_hit"
            else:
                reason = "kv_load"
        else:
            sticky = previous.replica if previous is not None else None
            ordered, overloaded = self._affinity(ranked, preference, sticky)
            chosen = ordered[0]
            reason = "affinity_overload" if overloaded else f"affinity_{fallback}"
        t_score = time.perf_counter()

        predicted = chosen.predicted_cached_tokens if hits is not None else None
        # Calibration learns only from what the index itself predicted: a prediction
        # extended by provisional entries may fall short in a same-step burst.
        index_hit = None
        if predicted is not None and real is not None and hits is not None:
            if real.blocks(chosen.replica) == hits.blocks(chosen.replica):
                index_hit = predicted
        detail: dict[str, Any] = {
            "prompt_tokens": n_tokens if prompt is not None else None,
            "block_size": block_size if prompt is not None else None,
            "affinity_source": akey.source,
        }
        if akey.source in _SESSION_SOURCES:
            detail["session"] = akey.key
        if index_hit is not None:
            detail["index_predicted_cached_tokens"] = index_hit
        if not commit:
            detail["expected_cached_tokens"] = chosen.expected_cached_tokens
            detail["replicas"] = [s.as_dict() for s in ordered]
            detail["fallback"] = fallback
        decision = Decision(
            replicas=tuple(s.replica for s in ordered),
            policy=self.name,
            reason=reason,
            prompt_tokens=max(0, n_tokens - (predicted or 0)) if prompt is not None else None,
            predicted_cached_tokens=predicted,
            want_usage=True,
            detail=detail,
        )
        if commit:
            self._commit(request, decision, chosen, prompt, akey, previous, now)
            if fallback is not None and fallback != "no_hit" and m is not None:
                m.fallbacks.labels(fallback).inc()
        if m is not None:
            self._stage["render"].observe(t_render - t0)
            self._stage["lookup"].observe(t_lookup - t_render)
            self._stage["score"].observe(t_score - t_lookup)
            self._route_hist.observe(time.perf_counter() - t0)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "route %s kv reason=%s chosen=%s prompt=%d predicted=%s scores=%s",
                request.request_id, reason, chosen.replica, n_tokens, predicted,
                [(s.replica, round(s.score, 1), round(s.expected_cached_tokens, 1),
                  s.queued_prefill_tokens, s.decode_load, round(s.p_index, 2),
                  round(s.p_resident_tail, 2)) for s in ordered],
            )
        return decision

    async def _render(
        self, request: RouteRequest, candidates: Sequence[ReplicaId]
    ) -> Prompt | None:
        if request.endpoint == "other" or request.body is None:
            return None
        return await self._prompts.prompt(request, self._replica_url(candidates[0]))

    def _inputs(
        self,
        candidates: Sequence[ReplicaId],
        hits: PrefixHits,
        now: float,
        previous: SessionState | None,
        new_conversation: bool,
    ) -> tuple[list[ReplicaInput], bool]:
        """Scoring inputs per candidate, and whether every candidate's event source is
        live (a no-hit from a sighted index means "new prefix", not "unknown")."""
        cfg = self.config
        wall = self._wall()
        by_replica = hits.by_replica
        runs = sorted((h.blocks for h in by_replica.values()), reverse=True)
        second = runs[1] if len(runs) > 1 else 0
        prev_replica = previous.replica if previous is not None else None
        inputs = []
        sighted = True
        for r in candidates:
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
            # The tracker's queued prefill, except that the part this policy sent is
            # capped by the fluid estimate (see ``_fluid_queue``).
            mine = min(own.queued_prefill_tokens, self._mine.get(r, 0))
            queued_own = own.queued_prefill_tokens - mine + min(mine, self._fluid_queue(r, now))
            terms = combine_load(
                own_queued_prefill_tokens=queued_own,
                own_decoding=own.decoding,
                foreign_waiting=f_wait,
                foreign_running=f_run,
                foreign_prefill_tokens_per_request=cfg.foreign_prefill_tokens_per_request,
                scrape_age_s=age_s,
                prefill_tokens_per_s=cfg.costs.prefill_tokens_per_s,
                placements=self._placements(r, now) if new_conversation else 0.0,
            )
            fresh, live = self._freshness.get(r, now, wall, self.calibration.trust(r))
            sighted = sighted and live
            hit = by_replica.get(r, _NO_HIT)
            horizon = self.horizon.horizon_s(r, now)
            consumed = 0.0
            queue_ahead: float | None = None
            run = 0
            if r == prev_replica and previous is not None:
                consumed = self._tail_consumed(previous, horizon, now)
                if consumed > 0 and previous.free_mark and previous.blocks_mark:
                    queue_ahead, run = previous.free_mark, previous.blocks_mark
            inputs.append(ReplicaInput(
                replica=r,
                hit=hit,
                load=terms,
                freshness=fresh,
                horizon_s=horizon,
                free_blocks=self.horizon.free_blocks(r, now),
                tail_consumed=consumed,
                tail_queue_blocks=queue_ahead,
                tail_run_blocks=run,
                hot_blocks=min(hit.blocks, second),
                costs=cfg.costs,
            ))
            self._last_terms[r] = (terms, index_trust(fresh, cfg.weights))
        return inputs, sighted

    def _affinity(
        self,
        ranked: list[ReplicaScore],
        preference: Mapping[ReplicaId, int],
        sticky: ReplicaId | None = None,
    ) -> tuple[list[ReplicaScore], bool]:
        """The session's previous replica (where its cache is, whoever placed it), else
        ring order; unless the pinned replica is overloaded (abs and rel)."""
        last = len(preference)
        ordered = sorted(ranked, key=lambda s: (s.replica != sticky,
                                                preference.get(s.replica, last)))
        w = self.config.weights

        def cost(s: ReplicaScore) -> float:
            return w.beta * s.queued_prefill_tokens + w.gamma * s.decode_load

        pinned = ordered[0]
        least = min(ordered, key=lambda s: (cost(s), preference.get(s.replica, last)))
        c_pin, c_min = cost(pinned), cost(least)
        if (c_pin - c_min > self.config.balance_abs_tokens
                and c_pin > self.config.balance_rel * c_min):
            return [least, *(s for s in ordered if s is not least)], True
        return ordered, False

    def _commit(
        self,
        request: RouteRequest,
        decision: Decision,
        chosen: ReplicaScore,
        prompt: Prompt | None,
        akey: AffinityKey,
        previous: SessionState | None,
        now: float,
    ) -> None:
        m = self._metrics
        replica = chosen.replica
        if prompt is not None:
            self.provisional.add(replica, prompt.block_keys, now)
        if decision.prompt_tokens:
            self._fluid[replica] = (self._fluid_queue(replica, now) + decision.prompt_tokens,
                                    now)
            self._mine[replica] = self._mine.get(replica, 0) + decision.prompt_tokens
        if previous is None:
            self._placed[replica] = (self._placements(replica, now) + 1.0, now)
        if m is not None and decision.predicted_cached_tokens is not None:
            m.predicted_cached_tokens.labels(replica).inc(decision.predicted_cached_tokens)
            m.expected_cached_tokens.labels(replica).inc(chosen.expected_cached_tokens)
        if akey.source not in _SESSION_SOURCES:
            return
        track = (self.config.detect_prefix_breaks and akey.source == "session"
                 and prompt is not None)
        tokens = pack_tokens(prompt.token_ids) if track and prompt is not None else b""
        shape = prompt_shape(request.body) if track else None
        prev = self.sessions.turn(akey.key, replica, now, tokens, shape)
        if prev is None:
            return
        if m is not None:
            m.session_turns.labels(self.name, "same_replica" if prev.replica == replica
                                   else "moved").inc()
            if prev.finished_at is not None:
                think = max(0.0, now - prev.finished_at)
                m.think_time.observe(think)
                outcome = classify_return(think, self.horizon.horizon_s(prev.replica, now))
                m.session_returns.labels(prev.replica, outcome).inc()
        if track and prev.tokens and prev.shape is not None and shape is not None:
            br = detect_break(prev.tokens, prev.shape, tokens, shape)
            if br is not None:
                if m is not None:
                    m.prefix_breaks.labels(br.cause).inc()
                    m.prefix_break_lost_tokens.inc(br.lost_tokens)
                _log.info(
                    "prefix break in request %s: cause=%s at token %d of %d (message %s, "
                    "role %s); %d cached tokens lost",
                    request.request_id, br.cause, br.position, br.previous_tokens,
                    br.message_index, br.message_role, br.lost_tokens,
                )

    @staticmethod
    def _released_blocks(decision: Decision, receipt: Receipt) -> int | None:
        """The blocks the finished request gave back to the pool (prompt and output),
        if its size is known."""
        detail = decision.detail
        tokens = receipt.prompt_tokens
        if tokens is None:
            tokens = detail.get("prompt_tokens")
        block_size = detail.get("block_size")
        if not isinstance(tokens, int) or not isinstance(block_size, int) or block_size <= 0:
            return None
        tokens += receipt.completion_tokens or 0
        return -(-tokens // block_size)

    def _tail_consumed(
        self, previous: SessionState, horizon: float | None, now: float
    ) -> float:
        """Share of the free pool the session's replica allocated since its last turn
        finished: from the allocation count (exact under bursts), else from the time in
        horizons."""
        if previous.finished_at is None:
            return 0.0  # still running: its blocks are pinned
        if previous.alloc_mark is not None and previous.free_mark:
            used = self.horizon.allocated(previous.replica) - previous.alloc_mark
            return max(0.0, used) / previous.free_mark
        if horizon is None or math.isinf(horizon) or horizon <= 0:
            return 0.0
        return max(0.0, now - previous.finished_at) / horizon

    def _fluid_queue(self, replica: ReplicaId, now: float) -> float:
        """Prefill tokens this policy sent to ``replica`` that a replica prefilling at
        ``prefill_tokens_per_s`` would not have finished yet (a fluid FIFO queue).

        It caps the load tracker's queued prefill, which for non-streaming requests
        stays raised until the whole answer arrives (vLLM sends nothing before), long
        after the prefill ended."""
        queued, since = self._fluid.get(replica, (0.0, now))
        return max(0.0, queued - self.config.costs.prefill_tokens_per_s * (now - since))

    def _placements(self, replica: ReplicaId, now: float) -> float:
        """New conversations recently placed on ``replica`` (decaying, tau
        ``placement_tau_s``)."""
        value, since = self._placed.get(replica, (0.0, now))
        if value == 0.0:
            return 0.0
        return value * math.exp(-(now - since) / self.config.placement_tau_s)

    # ------------------------------------------------------------------ metrics
    def gauge_rows(self) -> Iterator[tuple[str, str, float]]:
        """Scrape-time gauge rows for ``KvMetrics`` (horizon, rate, load terms, trust)."""
        now = self._clock()
        for r, (terms, trust) in list(self._last_terms.items()):
            h = self.horizon.horizon_s(r, now)
            if h is not None:
                yield ("router_eviction_horizon_seconds", r, h)
            rate = self.horizon.allocation_rate(r)
            if rate is not None:
                yield ("router_kv_allocation_blocks_per_second", r, rate)
            yield ("router_kv_load_queued_prefill_tokens", r, terms.queued_prefill_tokens)
            yield ("router_kv_load_decode", r, terms.decode_load)
            yield ("router_kv_index_trust", r, trust)
