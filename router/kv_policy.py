"""The ``kv`` policy: route each request where its prompt's KV cache most likely is,
unless the queue there costs more than the cache saves.

Algorithm, per request (``KvPolicy.decide``, a pipeline of the parts below):

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
3. **Per-replica inputs** (``router.replica_view``): the router's own accounting
   (queued prefill tokens until the first byte, then decoding) merged with the
   replica's scraped ``/metrics`` (waiting, running; a stale scrape is unknown, not
   zero), the index freshness for that replica (event lag, disconnection, recent gaps
   and resets, receipt calibration), its eviction horizon and free pool
   (``router.horizon``: the scrape carried forward by the blocks this policy's requests
   release and the events' allocations) and, for the session's previous replica, how
   much of its free pool has been allocated since the session's last turn finished
   (LRU: its idle blocks are evicted once that share reaches one;
   ``router.session_tracker``).
4. **Pure scoring** (``router.scoring``): ``score = -alpha * new_tokens - beta *
   queued_prefill_tokens - gamma * decode_load - delta * placements`` where
   ``new_tokens`` is the prompt minus the *expected* cached tokens: a sum over usable
   matched blocks (last prompt token always recomputed) of P(hit) x tier value.  Blocks
   a second replica also holds (a popular prefix) count as hot.  ``placements`` (new
   conversations only) is the decaying count of new conversations recently placed on
   the replica: future load the queue does not show yet under paced traffic.
   For a later turn, each replica that holds less of the conversation than its previous
   replica is charged what the move costs the fleet beyond the request
   (``router.move_cost``: the recomputation delaying others on a busy target, the cache
   it displaces there and strands at the origin), so a turn leaves only when the queue
   it avoids is worth more (``scoring.price_moves``).  A new conversation is charged
   the reusable cache its context will displace on each replica (the mean conversation
   footprint times the replica's learnt reuse share; ``scoring.price_placements``), so
   conversations go where the cache is lost anyway rather than evenly into every cache.
   Then the look ahead (``router.fleet_outlook``): the returning conversations' context
   the request's allocations evict, the context it keeps itself, the wait for pool
   space, and a later turn's allowance to queue on its own replica short of the tail.
5. **Pick** (``router.kv_choice``): the best score; exact ties go by the request's
   consistent-hash ring order, so equal replicas (all holding a shared system prompt,
   no load) still spread new conversations.  A popular prefix whose holder is
   overloaded is computed on a second replica when the holder's queue outweighs the
   prefix: replication emerges from the queue term (reason ``kv_load``).
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

Then (``commit``; not for ``/debug/route``): record provisional entries and what was
sent (``ReplicaView.sent``), update the session (``router.session_tracker``: stickiness
counter, think time against the eviction horizon, prefix-break check), and count
predictions.  The decision's ``KvTicket`` carries what ``record`` needs; ``record``
closes the session's turn and checks the receipt: the reported ``cached_tokens``
against ``Decision.predicted_cached_tokens`` (histogram of the error per replica,
counter of large disagreements), and feeds the per-replica calibration.
``Decision.detail`` is debug output only.

``Decision.prompt_tokens`` is what the proxy charges the replica's queue for this
request (``LoadTracker.lease``): the tokens it must *prefill*, i.e. the prompt minus the
predicted cached tokens.  The full prompt length is in ``KvTicket.prompt_tokens``.

Reasons (bounded label values) are listed in ``router.kv_choice``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from index.status import SourceStatus
from index.store import IndexUnavailable, KVIndex
from kvkeys.types import PrefixHits, ReplicaId
from prompt.keyer import Prompt
from router.affinity import AffinityKey, AffinityRing, affinity_key
from router.decision_counts import count_moves, count_outlook, log_decision
from router.fleet_outlook import FleetOutlook, OutlookSettings, OutlookTerms
from router.horizon import HorizonEstimator
from router.kv_choice import Choice, ChoiceRules, Fallback, choose
from router.load import LoadTracker
from router.metrics import KvMetrics
from router.move_cost import FleetState, busy_share, price_moves, price_placement
from router.policy import Decision, Receipt, RouteRequest
from router.provisional import ProvisionalBlocks
from router.receipts import ReceiptCalibration
from router.replica_view import ReplicaView
from router.scoring import CostModel, ReplicaScore, ScoringWeights, rank_replicas
from router.scrape import Scrapes
from router.session_table import SessionState, SessionTable
from router.session_tracker import SessionTracker

__all__ = ["KvConfig", "KvPolicy", "KvTicket", "PromptSource"]

_log = logging.getLogger(__name__)

_EMPTY = PrefixHits()


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
    price_moves: bool = True
    """Charge a later turn's move what it costs the fleet (``router.move_cost``)."""
    price_placements: bool = True
    """Charge a new conversation's placement the cache it displaces (``router.move_cost``)."""
    price_future: bool = True
    """Look ahead (``router.fleet_outlook``)."""
    outlook: OutlookSettings = OutlookSettings()


@dataclass(frozen=True, slots=True)
class KvTicket:
    """What ``record`` needs to know of its decision (``Decision.ticket``)."""

    session: str | None
    """The session the turn belongs to, if the request names one."""
    prompt_tokens: int | None
    """The full prompt's length, when rendered."""
    block_size: int | None
    """The model's block size, when rendered."""
    calibration_cached_tokens: int | None
    """The prediction the receipt calibration learns from: the index's own, ``None``
    when provisional entries extended the chosen replica's hit."""

    def released_blocks(self, receipt: Receipt) -> int | None:
        """The blocks the finished request gave back to the pool (prompt and output),
        if its size is known."""
        tokens = receipt.prompt_tokens
        if tokens is None:
            tokens = self.prompt_tokens
        if tokens is None or self.block_size is None or self.block_size <= 0:
            return None
        tokens += receipt.completion_tokens or 0
        return -(-tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The index's answer: its own hits, the hits with provisional entries, or why not."""

    real: PrefixHits | None
    hits: PrefixHits | None
    fallback: Fallback | None


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
        scraper: Scrapes | None = None,
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
        self._replica_url = replica_url
        self._metrics = metrics
        self.config = config
        self.horizon = horizon if horizon is not None else HorizonEstimator()
        self.ring = ring if ring is not None else AffinityRing()
        self.provisional = provisional if provisional is not None else ProvisionalBlocks()
        self.calibration = calibration if calibration is not None else ReceiptCalibration()
        self._clock = clock
        self._wall = wall
        self._rng = rng if rng is not None else random.Random()
        self._rules = ChoiceRules(config.weights, config.min_hit_tokens, config.temperature,
                                  config.balance_abs_tokens, config.balance_rel)
        self.view = ReplicaView(
            load=load, horizon=self.horizon, calibration=self.calibration,
            statuses=statuses, scraper=scraper, weights=config.weights, costs=config.costs,
            foreign_prefill_tokens_per_request=config.foreign_prefill_tokens_per_request,
            placement_tau_s=config.placement_tau_s,
        )
        self.tracker = SessionTracker(
            sessions=sessions if sessions is not None else SessionTable(),
            horizon=self.horizon, calibration=self.calibration, metrics=metrics,
            policy_name=self.name, detect_prefix_breaks=config.detect_prefix_breaks,
            receipt_large_abs_tokens=config.receipt_large_abs_tokens,
            receipt_large_rel=config.receipt_large_rel,
        )
        self.sessions = self.tracker.sessions
        self.outlook = FleetOutlook(
            self.horizon, config.outlook, prefill_tokens_per_s=config.costs.prefill_tokens_per_s,
            alpha=config.weights.alpha, beta=config.weights.beta)
        if metrics is not None:
            self._route_hist = metrics.route_seconds.labels(self.name)
            self._stage = {s: metrics.stage_seconds.labels(s)
                           for s in ("render", "lookup", "score")}

    # ------------------------------------------------------------------ Policy
    async def route(
        self, request: RouteRequest, candidates: Sequence[ReplicaId]
    ) -> Decision[KvTicket]:
        """Decide and commit (provisional entries, session bookkeeping, counters)."""
        return await self.decide(request, candidates, commit=True)

    def record(
        self, request: RouteRequest, decision: Decision[KvTicket], receipt: Receipt
    ) -> None:
        """Check the receipt against the prediction; close the session's turn."""
        now = self._clock()
        self.view.finished(decision.replica, decision.prompt_tokens or 0)
        ticket = decision.ticket
        released = ticket.released_blocks(receipt) if ticket is not None else None
        session = ticket.session if ticket is not None else None
        self.tracker.finished(session, receipt.replica, released, now)
        self.outlook.finished(request.request_id, session, receipt.replica, released,
                              receipt.ttfb_s, receipt.completion_tokens, now)
        # Checked against the prediction for the replica that served (a failover too).
        predicted = decision.predicted_for(receipt.replica)
        if predicted is None or not receipt.ok:
            return
        # Calibration learns only from the first choice's own index prediction (``None``
        # when provisional entries extended it, or after a failover).
        learn = None
        if receipt.replica == decision.replica and ticket is not None:
            learn = ticket.calibration_cached_tokens
        self.tracker.receipt(request, predicted, learn, receipt)

    # ------------------------------------------------------------------ pipeline
    async def decide(
        self, request: RouteRequest, candidates: Sequence[ReplicaId], *, commit: bool
    ) -> Decision[KvTicket]:
        """The decision for ``request``; ``commit=False`` changes no state (debug).

        render -> lookup (+ provisional) -> per-replica inputs -> pure score -> pick."""
        t0 = time.perf_counter()
        now = self._clock()
        prompt = await self._render(request, candidates)
        t_render = time.perf_counter()
        keys = prompt.block_keys if prompt is not None else ()
        akey = affinity_key(request, keys, prefix_blocks=self.config.affinity_prefix_blocks)
        previous = self.tracker.previous(akey)
        found = await self._lookup(request, prompt, candidates, now)
        t_lookup = time.perf_counter()
        tail = None
        if previous is not None:
            held = found.hits.blocks(previous.replica) if found.hits is not None else None
            tail = self.tracker.tail(previous, now, held)
        inputs, sighted = self.view.inputs(
            candidates, found.hits or _EMPTY, now, self._wall(),
            tail=tail, new_conversation=previous is None,
        )
        n_tokens = prompt.num_tokens if prompt is not None else 0
        block_size = prompt.block_size if prompt is not None else 1
        ranked = rank_replicas(inputs, n_tokens, block_size, self.config.weights)
        ranked = self._price(ranked, previous, candidates, block_size)
        terms: Mapping[ReplicaId, OutlookTerms] = {}
        if self.config.price_future and prompt is not None:
            ranked = self.outlook.price(ranked, prompt, self.tracker.session_of(akey),
                                        previous.replica if previous else None, now)
            terms = self.outlook.last
        choice = choose(
            ranked, self.ring.preference(akey.key, candidates), self._rules,
            fallback=found.fallback, sighted=sighted,
            sticky=previous.replica if previous is not None else None,
            sample=self._rng.random, block_size=block_size,
        )
        t_score = time.perf_counter()
        decision = self._decision(prompt, akey, found, choice, dry_run=not commit,
                                  terms=terms)
        if commit and terms and self._metrics is not None:
            count_outlook(self._metrics, decision.replica, terms)
        if commit:
            # Read before the turn is recorded (the table updates the state in place).
            moves = (previous.replica, previous.left) if previous is not None else None
            self._commit(request, decision, choice, prompt, akey, previous, now)
            if moves is not None:
                if self._metrics is not None:
                    count_moves(self._metrics, *moves, choice)
        if self._metrics is not None:
            self._stage["render"].observe(t_render - t0)
            self._stage["lookup"].observe(t_lookup - t_render)
            self._stage["score"].observe(t_score - t_lookup)
            self._route_hist.observe(time.perf_counter() - t0)
        log_decision(request, decision, choice, n_tokens)
        return decision

    def _price(
        self,
        ranked: list[ReplicaScore],
        previous: SessionState | None,
        candidates: Sequence[ReplicaId],
        block_size: int,
    ) -> list[ReplicaScore]:
        """``ranked`` with what the decision costs the fleet beyond the request: a later
        turn's move, a new conversation's placement (``router.move_cost``)."""
        alpha = self.config.weights.alpha
        if previous is not None and self.config.price_moves:
            return price_moves(ranked, previous.replica,
                               self._fleet_states(candidates, block_size), alpha)[0]
        if previous is None and self.config.price_placements:
            footprint = self.tracker.footprint_blocks()
            if footprint is not None:
                return price_placement(ranked, self._fleet_states(candidates, block_size),
                                       footprint * block_size, alpha)[0]
        return ranked

    def _fleet_states(
        self, candidates: Sequence[ReplicaId], block_size: int
    ) -> dict[ReplicaId, FleetState]:
        """Busy and reuse shares per candidate, for pricing moves (``router.move_cost``)."""
        rate = self.config.costs.prefill_tokens_per_s
        return {r: FleetState(busy=busy_share(self.horizon.allocation_rate(r), block_size, rate),
                              reuse=self.tracker.reuse_share(r))
                for r in candidates}

    async def _render(
        self, request: RouteRequest, candidates: Sequence[ReplicaId]
    ) -> Prompt | None:
        if request.endpoint == "other" or request.body is None:
            return None
        return await self._prompts.prompt(request, self._replica_url(candidates[0]))

    async def _lookup(
        self,
        request: RouteRequest,
        prompt: Prompt | None,
        candidates: Sequence[ReplicaId],
        now: float,
    ) -> _Lookup:
        """The index's hits for the prompt's block keys extended by provisional entries,
        or the reason there are none."""
        if prompt is None:
            return _Lookup(None, None, "no_prompt")
        if self._index is None:
            return _Lookup(None, None, "index_down")
        try:
            hits = await self._index.lookup(prompt.block_keys, among=candidates)
        except IndexUnavailable as exc:
            _log.debug("index unavailable for %s: %s", request.request_id, exc)
            return _Lookup(None, None, "index_down")
        return _Lookup(hits, self.provisional.overlay(hits, prompt.block_keys, now, candidates),
                       None)

    def _decision(
        self,
        prompt: Prompt | None,
        akey: AffinityKey,
        found: _Lookup,
        choice: Choice,
        *,
        dry_run: bool,
        terms: Mapping[ReplicaId, OutlookTerms],
    ) -> Decision[KvTicket]:
        """The decision, its ticket for ``record`` and its debug detail (a dry run's
        has every candidate's score and look-ahead forecasts)."""
        chosen = choice.chosen
        predicted = chosen.predicted_cached_tokens if found.hits is not None else None
        # Calibration learns only from what the index itself predicted: a prediction
        # extended by provisional entries may fall short in a same-step burst.
        index_hit = None
        if predicted is not None and found.real is not None and found.hits is not None:
            if found.real.blocks(chosen.replica) == found.hits.blocks(chosen.replica):
                index_hit = predicted
        session = self.tracker.session_of(akey)
        ticket = KvTicket(
            session=session,
            prompt_tokens=prompt.num_tokens if prompt is not None else None,
            block_size=prompt.block_size if prompt is not None else None,
            calibration_cached_tokens=index_hit,
        )
        detail: dict[str, Any] = {
            "prompt_tokens": ticket.prompt_tokens,
            "block_size": ticket.block_size,
            "affinity_source": akey.source,
        }
        if session is not None:
            detail["session"] = session
        if index_hit is not None:
            detail["index_predicted_cached_tokens"] = index_hit
        if dry_run:
            detail["expected_cached_tokens"] = chosen.expected_cached_tokens
            detail["replicas"] = [s.as_dict() for s in choice.ordered]
            detail["fallback"] = choice.fallback
            if terms:
                detail["outlook"] = {
                    r: {"displaced_tokens": round(t.displaced_tokens, 1),
                        "retained_tokens": round(t.retained_tokens, 1),
                        "pool_wait_s": round(t.pool_wait_s, 4)}
                    for r, t in terms.items()}
        n_tokens = prompt.num_tokens if prompt is not None else 0
        return Decision(
            replicas=tuple(s.replica for s in choice.ordered),
            policy=self.name,
            reason=choice.reason,
            prompt_tokens=max(0, n_tokens - (predicted or 0)) if prompt is not None else None,
            predicted_cached_tokens=predicted,
            want_usage=True,
            detail=detail,
            ticket=ticket,
            predicted_by_replica=({s.replica: s.predicted_cached_tokens for s in choice.ordered}
                                  if found.hits is not None else {}),
        )

    def _commit(
        self,
        request: RouteRequest,
        decision: Decision[KvTicket],
        choice: Choice,
        prompt: Prompt | None,
        akey: AffinityKey,
        previous: SessionState | None,
        now: float,
    ) -> None:
        """The routed request's state: provisional blocks, what we sent, the session's
        turn, the look ahead's pinned blocks and pause, and the prediction counters."""
        m = self._metrics
        replica = decision.replica
        if prompt is not None:
            self.provisional.add(replica, prompt.block_keys, now)
            self.outlook.routed(request.request_id, self.tracker.session_of(akey), replica,
                                prompt, choice.ordered,
                                previous.finished_at if previous else None, now)
        self.view.sent(replica, decision.prompt_tokens or 0, now,
                       new_conversation=previous is None)
        if m is not None and decision.predicted_cached_tokens is not None:
            m.predicted_cached_tokens.labels(replica).inc(decision.predicted_cached_tokens)
            m.expected_cached_tokens.labels(replica).inc(choice.chosen.expected_cached_tokens)
        self.tracker.turn(request, akey, replica, prompt, now)
        fallback = choice.fallback
        if fallback is not None and fallback != "no_hit" and m is not None:
            m.fallbacks.labels(fallback).inc()

    def forget(self, replica: ReplicaId) -> None:
        """Drop what the policy learnt of ``replica``: it left the fleet, joined anew or
        restarted (its caches are empty, its counters start again).  Provisional
        entries, the horizon and pool, receipt trust, the look ahead's paused
        conversations and pinned blocks, and the load view's remembered terms."""
        self.provisional.forget(replica)
        self.horizon.forget(replica)
        self.calibration.forget(replica)
        self.outlook.forget(replica)
        self.view.forget(replica)

    # ------------------------------------------------------------------ metrics
    def gauge_rows(self) -> Iterator[tuple[str, str, float]]:
        """Scrape-time gauge rows for ``KvMetrics`` (horizon, rate, load terms, trust)."""
        yield from self.view.gauge_rows(self._clock())
