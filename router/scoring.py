"""Pure scoring of replicas for one request: expected cached work against queued work.

Contract: nothing in this module awaits, reads a clock, draws random numbers, logs or
keeps state.  Every input (times, loads, index freshness, randomness for sampling) is an
argument, so a decision can be replayed from its inputs and asserted in table tests.

The score of replica ``r`` for a prompt of ``n`` tokens (block size ``B``)::

    score(r) = -alpha * new_tokens(r) - beta * queued_prefill_tokens(r) - gamma * decode_load(r)
               - delta * placements(r)
    new_tokens(r) = n - expected_cached_tokens(r)
    expected_cached_tokens(r) = B * sum over usable matched blocks i of  P_i(r) * v_tier(i)

* usable blocks: at most ``(n - 1) // B`` leading blocks (vLLM recomputes the last
  token), taken GPU first, then CPU, then storage;
* ``v_tier`` (``tier_value``): 1 on GPU; for an offloaded block, ``1 - reload_time /
  recompute_time`` clamped to ``[0, 1]``, from the configured bandwidths and prefill rate;
* ``P_i = p_index * p_resident``: how far the index is trusted for the replica
  (``index_trust``), times the chance the block survives vLLM's LRU free queue until the
  request is scheduled (``resident_probability`` over the block's eviction pressure);
* the load terms combine the router's own accounting with the foreign load a scrape
  shows (``combine_load``, ``foreign_load``); ``placements`` counts recent new
  conversations and is charged to new conversations only.

All weights are in tokens (``alpha = beta = 1``: the score is minus the prefill ahead of
the first token).  ``pick`` takes the best score, breaking exact ties by a preference
order passed in, or samples a softmax when ``temperature > 0``.  The reasoning behind
each term is in ``docs/architecture.md`` (section "Scoring").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from kvkeys.types import ReplicaHit, ReplicaId
from router.residency import Tiers, in_horizons, resident_probability, tail_run

__all__ = [
    "CostModel",
    "Freshness",
    "LoadTerms",
    "ReplicaInput",
    "ReplicaScore",
    "ScoringWeights",
    "combine_load",
    "foreign_load",
    "index_trust",
    "pick",
    "rank_replicas",
    "resident_probability",
    "score_replica",
    "tier_value",
]


@dataclass(frozen=True, slots=True)
class CostModel:
    """What it costs a replica to recompute a token versus reloading its KV from a tier.

    Defaults size a Llama-3-8B class model (32 layers x 8 KV heads x 128 dims x 2 (K and
    V) x 2 bytes = 128 KiB per token) on one H100-class GPU (~20k prefill tokens/s), with
    PCIe Gen4 host links (~25 GB/s effective) and NVMe storage (~3 GB/s).  That gives a CPU
    block ~0.9 of a GPU block and a storage block ~0.1: configure yours.
    """

    kv_bytes_per_token: float = 131072.0
    prefill_tokens_per_s: float = 20000.0
    cpu_bandwidth_bytes_per_s: float = 25e9
    storage_bandwidth_bytes_per_s: float = 3e9


def tier_value(bandwidth_bytes_per_s: float, costs: CostModel) -> float:
    """The worth of one cached token reloaded over a link, in recomputed tokens.

    ``1 - reload_time / recompute_time`` clamped to ``[0, 1]``; a non-positive bandwidth
    makes reloading worthless (0)."""
    if bandwidth_bytes_per_s <= 0 or costs.prefill_tokens_per_s <= 0:
        return 0.0
    reload_s = costs.kv_bytes_per_token / bandwidth_bytes_per_s
    recompute_s = 1.0 / costs.prefill_tokens_per_s
    return min(1.0, max(0.0, 1.0 - reload_s / recompute_s))


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current the index is for one replica, as seen at decision time."""

    lag_s: float = 0.0
    """How long ago the index last reflected the replica: the transport lag of applied
    events while connected; the time since the source went quiet while disconnected."""
    connected: bool = True
    since_gap_s: float | None = None
    """Seconds since the last sequence gap (missed events), ``None`` if never."""
    since_reset_s: float | None = None
    """Seconds since the last reset (restart, ``AllBlocksCleared``, resync), if any."""
    receipt_trust: float = 1.0
    """Calibration from receipts in ``[0, 1]``: how much of predicted hits came true."""


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class LoadTerms:
    """The load terms of the score, in the units the weights expect."""

    queued_prefill_tokens: float = 0.0
    """Prefill tokens ahead of this request (own not-yet-first-token + foreign waiting)."""
    decode_load: float = 0.0
    """Sequences decoding on the replica."""
    placements: float = 0.0
    """Recent new conversations placed there (new conversations only; else 0)."""
    known: bool = True
    """False when neither own accounting nor a fresh scrape said anything."""


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class ReplicaInput:
    """Everything the score of one replica depends on."""

    replica: ReplicaId
    hit: ReplicaHit
    load: LoadTerms
    freshness: Freshness = Freshness()
    horizon_s: float | None = None
    """Eviction horizon: how long an idle block survives; ``None`` = no eviction risk
    measured."""
    free_blocks: float | None = None
    """The replica's free (incl. evictable) KV blocks, if scraped."""
    tail_consumed: float = 0.0
    """Share of the free pool allocated since this request's own (non-hot) blocks were
    last used on the replica (1 = they are gone by LRU)."""
    tail_queue_blocks: float | None = None
    """The free blocks ahead of the session's blocks in the LRU queue when its last turn
    finished (``tail_consumed`` is a share of it); with ``tail_run_blocks``, each tail
    block gets its own depth.  ``None``: every tail block is taken to be at the front."""
    tail_run_blocks: int = 0
    """The blocks the session's last turn released (prompt and output), block 0 deepest."""
    hot_blocks: int = 0
    """Leading blocks of the run that are popular (held elsewhere too): age 0."""
    costs: CostModel = CostModel()


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """The knobs of the score.  See the module docstring for the formula."""

    alpha: float = 1.0
    """Weight of the prefill tokens the replica would compute for this request."""
    beta: float = 1.0
    """Weight of the prefill tokens already queued there (same unit: equal by default)."""
    gamma: float = 32.0
    """Prefill-token equivalent of one decoding sequence (it shares every batch step)."""
    delta: float = 512.0
    """Prefill-token cost of one recent new conversation already placed on the replica
    (for new conversations): a 1.5k-token shared prompt is replicated once the session
    imbalance reaches 3 (the benchmark's shape); bursts of one session are not affected."""
    horizon_spread: float = 0.5
    """Relative uncertainty of the eviction horizon (survival ramps over +-spread)."""
    disconnected_trust: float = 0.5
    """Index trust for a replica whose event source is disconnected (lag adds to this)."""
    gap_trust: float = 0.5
    """Index trust right after a sequence gap; recovers linearly over ``gap_window_s``."""
    gap_window_s: float = 30.0
    reset_trust: float = 0.5
    """Index trust right after a reset/restart; recovers over ``reset_window_s``."""
    reset_window_s: float = 10.0


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class ReplicaScore:
    """The score of one replica with its full breakdown (for logs, debug and tests)."""

    replica: ReplicaId
    matched_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    storage_blocks: int
    usable_blocks: int
    """Matched blocks after the last-token rule."""
    predicted_cached_tokens: int
    """Point prediction: the tokens the engine is most likely to report, i.e. the
    usable matched blocks whose hit probability is at least one half (all of them
    when nothing is stale or under eviction pressure)."""
    expected_cached_tokens: float
    """``B * sum P_i * v_i``: what the score credits."""
    p_index: float
    p_resident_hot: float
    p_resident_tail: float
    wait_s: float
    new_tokens: float
    queued_prefill_tokens: float
    decode_load: float
    placements: float
    load_known: bool
    score: float

    def as_dict(self) -> dict[str, object]:
        """JSON-ready breakdown."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def rescored(self, score: float) -> ReplicaScore:
        """This breakdown with another ``score`` (``dataclasses.replace(self,
        score=score)`` at half its cost: pricing rescores most replicas per request)."""
        return ReplicaScore(
            self.replica, self.matched_blocks, self.gpu_blocks, self.cpu_blocks,
            self.storage_blocks, self.usable_blocks, self.predicted_cached_tokens,
            self.expected_cached_tokens, self.p_index, self.p_resident_hot,
            self.p_resident_tail, self.wait_s, self.new_tokens, self.queued_prefill_tokens,
            self.decode_load, self.placements, self.load_known, score,
        )


def index_trust(f: Freshness, w: ScoringWeights) -> float:
    """``p_index``: the product of the disconnection, gap, reset and receipt factors."""
    p = min(1.0, max(0.0, f.receipt_trust))
    if not f.connected:
        p *= w.disconnected_trust
    p *= _recovering(f.since_gap_s, w.gap_trust, w.gap_window_s)
    p *= _recovering(f.since_reset_s, w.reset_trust, w.reset_window_s)
    return p


def _recovering(since_s: float | None, floor: float, window_s: float) -> float:
    if since_s is None or window_s <= 0 or since_s >= window_s:
        return 1.0
    return floor + (1.0 - floor) * max(0.0, since_s) / window_s


def combine_load(
    *,
    own_queued_prefill_tokens: float,
    own_decoding: int,
    foreign_waiting: float | None = None,
    foreign_running: float | None = None,
    foreign_prefill_tokens_per_request: float = 512.0,
    scrape_age_s: float = 0.0,
    prefill_tokens_per_s: float = 0.0,
    placements: float = 0.0,
) -> LoadTerms:
    """Merge the router's own accounting with the foreign load a scrape revealed.

    ``foreign_waiting`` / ``foreign_running`` are the replica's scraped queue and batch
    minus what this router itself had there *at the scrape* (``foreign_load``), so our
    own requests are never counted twice however stale the scrape.  Foreign queued
    prefill is ``foreign_waiting * foreign_prefill_tokens_per_request``, drained at
    ``prefill_tokens_per_s`` for the ``scrape_age_s`` since the scrape (a fluid queue:
    the replica kept working); foreign decoding adds to ours.  ``None`` (stale or no
    scrape) is unknown and adds nothing: our own accounting stands alone, never
    masked by zeros."""
    queued = max(0.0, own_queued_prefill_tokens)
    decode = float(max(0, own_decoding))
    known = own_queued_prefill_tokens > 0 or own_decoding > 0
    if foreign_waiting is not None:
        known = True
        backlog = max(0.0, foreign_waiting) * max(0.0, foreign_prefill_tokens_per_request)
        queued += max(0.0, backlog - max(0.0, prefill_tokens_per_s) * max(0.0, scrape_age_s))
    if foreign_running is not None:
        known = True
        decode += max(0.0, foreign_running)
    return LoadTerms(queued_prefill_tokens=queued, decode_load=decode,
                     placements=max(0.0, placements), known=known)


def foreign_load(
    *,
    scraped_waiting: float | None,
    scraped_running: float | None,
    own_queued_then: int,
    own_in_flight_then: int,
) -> tuple[float | None, float | None]:
    """``(foreign waiting, foreign running)``: what a scrape shows beyond this router's
    own requests at the time of the scrape (``None`` when the scrape lacks the gauge)."""
    if scraped_waiting is None or scraped_running is None:
        return None, None
    total = max(0.0, scraped_waiting + scraped_running - own_in_flight_then)
    waiting = min(total, max(0.0, scraped_waiting - own_queued_then))
    return waiting, total - waiting


def _tier_values(costs: CostModel) -> tuple[float, float]:
    return (tier_value(costs.cpu_bandwidth_bytes_per_s, costs),
            tier_value(costs.storage_bandwidth_bytes_per_s, costs))


def score_replica(
    inp: ReplicaInput,
    prompt_tokens: int,
    block_size: int,
    w: ScoringWeights,
    tier_values: tuple[float, float] | None = None,
) -> ReplicaScore:
    """Score one replica (see the module docstring).  ``tier_values`` (CPU, storage) may
    be passed precomputed for ``inp.costs``."""
    hit = inp.hit
    cap = max(0, (prompt_tokens - 1) // block_size) if block_size > 0 else 0
    usable = min(hit.blocks, cap)
    g = min(hit.gpu_blocks, usable)
    c = min(hit.cpu_blocks, usable - g)
    p_index = index_trust(inp.freshness, w)
    rate = inp.costs.prefill_tokens_per_s
    queued = inp.load.queued_prefill_tokens
    wait_s = queued / rate if rate > 0 else 0.0
    if g < usable and tier_values is None:
        tier_values = _tier_values(inp.costs)
    res = _residency(inp, usable, g, c, _pressure(inp, queued, wait_s, block_size), p_index,
                     w.horizon_spread, tier_values)
    expected = block_size * p_index * res.weighted
    new_tokens = max(0.0, prompt_tokens - expected)
    score = (-w.alpha * new_tokens - w.beta * queued - w.gamma * inp.load.decode_load
             - w.delta * inp.load.placements)
    return ReplicaScore(
        replica=inp.replica,
        matched_blocks=hit.blocks,
        gpu_blocks=hit.gpu_blocks,
        cpu_blocks=hit.cpu_blocks,
        storage_blocks=hit.storage_blocks,
        usable_blocks=usable,
        predicted_cached_tokens=block_size * res.predicted_blocks,
        expected_cached_tokens=expected,
        p_index=p_index,
        p_resident_hot=res.p_hot,
        p_resident_tail=res.p_tail,
        wait_s=wait_s,
        new_tokens=new_tokens,
        queued_prefill_tokens=queued,
        decode_load=inp.load.decode_load,
        placements=inp.load.placements,
        load_known=inp.load.known,
        score=score,
    )


def _pressure(inp: ReplicaInput, queued: float, wait_s: float, block_size: int) -> float:
    """The eviction pressure on the replica's idle blocks until the request is scheduled:
    the index lag, plus the queue ahead (in free-pool shares when the pool is known)."""
    pressure = in_horizons(max(0.0, inp.freshness.lag_s), inp.horizon_s)
    if inp.free_blocks is not None and block_size > 0:
        return pressure + (queued / block_size) / max(inp.free_blocks, 1.0)
    return pressure + in_horizons(wait_s, inp.horizon_s)


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class _Residency:
    """What survives of the usable blocks: their summed ``P_i x tier value``, the blocks
    predicted resident, and the hot and tail residency probabilities."""

    weighted: float
    predicted_blocks: int
    p_hot: float
    p_tail: float


def _residency(
    inp: ReplicaInput,
    usable: int,
    g: int,
    c: int,
    pressure: float,
    p_index: float,
    spread: float,
    tier_values: tuple[float, float] | None,
) -> _Residency:
    """Residency of the usable blocks: the hot ones (recently used by others) under
    ``pressure`` alone; the session's tail by its depth in the LRU queue when known."""
    hot = min(max(0, inp.hot_blocks), usable)
    p_hot = resident_probability(pressure, spread)
    predicted = hot if p_index * p_hot >= 0.5 else 0
    depth0 = inp.tail_queue_blocks
    consumed = max(0.0, inp.tail_consumed)
    if depth0 is None or depth0 <= 0 or consumed <= 0:  # every tail block at the front
        p_tail = resident_probability(pressure + consumed, spread)
        predicted += usable - hot if p_index * p_tail >= 0.5 else 0
        if g == usable:  # all on GPU: the common case
            return _Residency(p_hot * hot + p_tail * (usable - hot), predicted, p_hot, p_tail)
        tiers = Tiers(g, g + c, tier_values or (1.0, 1.0))
        weighted = p_hot * tiers.value(0, hot) + p_tail * tiers.value(hot, usable)
        return _Residency(weighted, predicted, p_hot, p_tail)
    # Block i of the session's run left the LRU queue's head ``depth0 + run - 1 - i``
    # blocks away (freed last to first): it is gone once that many blocks have been
    # allocated, so the run is evicted from its end and its leading blocks survive.
    tiers = Tiers(g, g + c, tier_values or (1.0, 1.0))
    free_ref = inp.free_blocks if inp.free_blocks is not None else depth0
    # an infinite pressure (lag over a horizon near 0) evicts everything, even with
    # an empty free pool (where inf * 0 would be NaN)
    allocations = (math.inf if math.isinf(pressure)
                   else consumed * depth0 + pressure * free_ref)
    weighted_tail, resident, total = tail_run(
        allocations, depth0, inp.tail_run_blocks, hot, usable, p_hot, spread, tiers, p_index,
    )  # fmt: skip
    front = total / (usable - hot) if usable > hot else resident_probability(
        allocations / depth0, spread)
    p_tail = min(p_hot, front)  # the run's mean (rounding kept below the cap)
    return _Residency(p_hot * tiers.value(0, hot) + weighted_tail, predicted + resident,
                      p_hot, p_tail)


def rank_replicas(
    inputs: Sequence[ReplicaInput], prompt_tokens: int, block_size: int, w: ScoringWeights
) -> list[ReplicaScore]:
    """Score every replica; best first, ties in input order (``sorted`` is stable)."""
    cache: dict[int, tuple[CostModel, tuple[float, float]]] = {}
    scores = []
    for i in inputs:
        entry = cache.get(id(i.costs))
        if entry is None:
            entry = cache[id(i.costs)] = (i.costs, _tier_values(i.costs))
        scores.append(score_replica(i, prompt_tokens, block_size, w, entry[1]))
    scores.sort(key=lambda s: -s.score)
    return scores


def pick(
    ranked: Sequence[ReplicaScore],
    *,
    preference: Mapping[ReplicaId, int],
    temperature: float = 0.0,
    u: float = 0.0,
) -> list[ReplicaScore]:
    """Order replicas for a decision: the choice first, then failover candidates.

    ``preference`` ranks replicas (lower first) for breaking exact ties, e.g. the
    request's consistent-hash ring order; replicas missing from it go last.  With
    ``temperature > 0`` (tokens), the first replica is drawn from
    ``softmax(score / temperature)`` using ``u`` in ``[0, 1)``; the rest stay in
    score order."""
    if not ranked:
        return []
    last = len(preference)
    ordered = sorted(ranked, key=lambda s: (-s.score, preference.get(s.replica, last)))
    if temperature <= 0 or len(ordered) == 1:
        return ordered
    top = ordered[0].score
    if not math.isfinite(top):  # no finite score to weigh against: keep score order
        return ordered
    weights = [math.exp((s.score - top) / temperature) for s in ordered]
    total = sum(weights)
    target = min(max(u, 0.0), 1.0) * total
    acc = 0.0
    chosen = len(ordered) - 1
    for i, wt in enumerate(weights):
        acc += wt
        if target < acc:
            chosen = i
            break
    return [ordered[chosen], *ordered[:chosen], *ordered[chosen + 1 :]]
