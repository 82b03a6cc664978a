"""Table-driven and property tests of the pure scoring function."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkeys.types import ReplicaHit, ReplicaId
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
    resident_probability,
    score_replica,
    tier_value,
)

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
W = ScoringWeights()
BS = 16


def inp(
    replica: ReplicaId = A,
    gpu: int = 0,
    cpu: int = 0,
    storage: int = 0,
    queued: float = 0.0,
    decode: float = 0.0,
    load: LoadTerms | None = None,
    **kw: object,
) -> ReplicaInput:
    return ReplicaInput(
        replica=replica,
        hit=ReplicaHit(gpu, cpu, storage),
        load=load or LoadTerms(queued_prefill_tokens=queued, decode_load=decode),
        **kw,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- a session's run under LRU

def test_a_session_run_is_evicted_from_its_end() -> None:
    # 10 blocks freed (last to first) behind 20 free ones; 25 allocations since: the
    # queue's head has eaten the 20 and the run's last 5 blocks.  Its first 5 survive.
    exact = replace(W, horizon_spread=0.0)
    run = inp(gpu=10, tail_consumed=25 / 20, tail_queue_blocks=20, tail_run_blocks=10)
    s = score_replica(run, 200, BS, exact)
    assert s.expected_cached_tokens == 5 * BS and s.predicted_cached_tokens == 5 * BS
    assert s.p_resident_tail == pytest.approx(0.5)
    # Without the run's depth every block is taken to be at the queue's front: all gone.
    front = score_replica(replace(run, tail_queue_blocks=None), 200, BS, exact)
    assert front.expected_cached_tokens == 0
    # The queue ahead of the request allocates too (400 tokens = 25 blocks over a free
    # pool of 50: pressure 0.5), before it is scheduled: 25 + 25 allocations, 10 of 10 gone.
    queued = replace(run, load=LoadTerms(queued_prefill_tokens=400), free_blocks=50)
    assert score_replica(queued, 200, BS, exact).expected_cached_tokens == 0
    # A hot (shared) prefix is not part of the run's ageing; CPU blocks keep their value.
    hot = score_replica(replace(run, hot_blocks=3), 200, BS, exact)
    assert hot.expected_cached_tokens == 5 * BS
    tiered = replace(run, hit=ReplicaHit(2, 8, 0))
    v_cpu = tier_value(CostModel().cpu_bandwidth_bytes_per_s, CostModel())
    assert score_replica(tiered, 200, BS, exact).expected_cached_tokens == pytest.approx(
        (2 + 3 * v_cpu) * BS)


def test_a_session_run_ramps_smoothly_with_the_default_spread() -> None:
    run = inp(gpu=40, tail_consumed=1.5, tail_queue_blocks=40, tail_run_blocks=40)
    s = score_replica(run, 1000, BS, W)
    # 60 allocations against depths 79 (block 0) down to 40 (the last block): P ramps
    # from 1.5 - 60 / 79 = 0.74 at block 0 to 0 at the front (60 / 40 = 1.5).
    assert 0 < s.expected_cached_tokens < 40 * BS
    # the point prediction is the leading blocks with P >= 1/2: depth >= 60 -> 20 blocks
    assert s.predicted_cached_tokens == 20 * BS
    older = score_replica(replace(run, tail_consumed=2.0), 1000, BS, W)
    assert older.expected_cached_tokens < s.expected_cached_tokens


# ---------------------------------------------------------------- table: score values

@pytest.mark.parametrize(
    ("name", "replica_input", "prompt", "cached", "score"),
    [
        ("cold, idle", inp(), 100, 0, -100.0),
        ("3 gpu blocks", inp(gpu=3), 100, 48, -52.0),
        # last-token rule: 64 tokens -> at most (64-1)//16 = 3 blocks can hit
        ("all 4 blocks held, prompt of exactly 4 blocks", inp(gpu=4), 64, 48, -16.0),
        ("prompt shorter than a block", inp(gpu=1), 10, 0, -10.0),
        ("queued prefill", inp(gpu=3, queued=500), 100, 48, -552.0),
        ("decode load", inp(gpu=3, decode=2), 100, 48, -52.0 - 2 * W.gamma),
        ("tail well within the pool", inp(gpu=3, tail_consumed=0.4), 100, 48, -52.0),
        ("tail half-way down the ramp", inp(gpu=3, tail_consumed=1.0), 100, 24, -76.0),
        ("tail expired, hot prefix survives", inp(gpu=4, hot_blocks=2, tail_consumed=2.0),
         100, 32, -68.0),
        ("everything expired", inp(gpu=4, tail_consumed=2.0), 100, 0, -100.0),
        # 400 queued tokens will allocate 25 blocks of a 10-block free pool first
        ("the queue ahead evicts it", inp(gpu=4, queued=400, free_blocks=10), 100, 0, -500.0),
        ("a big pool absorbs the queue", inp(gpu=4, queued=400, free_blocks=1000), 100, 64,
         -436.0),
    ],
)
def test_score_table(
    name: str, replica_input: ReplicaInput, prompt: int, cached: float, score: float
) -> None:
    s = score_replica(replica_input, prompt, BS, W)
    assert s.expected_cached_tokens == pytest.approx(cached), name
    assert s.score == pytest.approx(score), name


@pytest.mark.parametrize(
    ("costs", "value"),
    [
        # 128 KiB/token over 25 GB/s = 5.24 us; recompute 50 us -> 0.895
        (CostModel(), 1 - (131072 / 25e9) * 20000),
        # link as slow as recompute: worthless
        (CostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1000,
                   cpu_bandwidth_bytes_per_s=1e6), 0.0),
        # link slower than recompute: clamped at 0, never negative
        (CostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1000,
                   cpu_bandwidth_bytes_per_s=1e5), 0.0),
        # infinitely fast recompute relative to link: 0; near-free reload: ~1
        (CostModel(kv_bytes_per_token=1, prefill_tokens_per_s=1,
                   cpu_bandwidth_bytes_per_s=1e12), 1 - 1e-12),
        (CostModel(cpu_bandwidth_bytes_per_s=0), 0.0),
    ],
)
def test_tier_value_from_costs(costs: CostModel, value: float) -> None:
    assert tier_value(costs.cpu_bandwidth_bytes_per_s, costs) == pytest.approx(value)


def test_cpu_blocks_count_at_the_derived_discount() -> None:
    costs = CostModel()
    v_cpu = tier_value(costs.cpu_bandwidth_bytes_per_s, costs)
    v_sto = tier_value(costs.storage_bandwidth_bytes_per_s, costs)
    s = score_replica(inp(gpu=2, cpu=2, storage=2), 1000, BS, W)
    assert s.expected_cached_tokens == pytest.approx(BS * (2 + 2 * v_cpu + 2 * v_sto))
    assert s.predicted_cached_tokens == 6 * BS
    assert 0 < v_sto < v_cpu < 1


def test_last_token_rule_drops_slowest_tier_first() -> None:
    # 3 usable blocks of 4 held: the storage block is the one that cannot hit
    s = score_replica(inp(gpu=2, cpu=1, storage=1), 64, BS, W)
    costs = CostModel()
    v_cpu = tier_value(costs.cpu_bandwidth_bytes_per_s, costs)
    assert s.usable_blocks == 3
    assert s.expected_cached_tokens == pytest.approx(BS * (2 + v_cpu))


@pytest.mark.parametrize(
    ("freshness", "trust"),
    [
        (Freshness(), 1.0),
        (Freshness(connected=False), 0.5),
        (Freshness(since_gap_s=0.0), 0.5),
        (Freshness(since_gap_s=15.0), 0.75),
        (Freshness(since_gap_s=30.0), 1.0),
        (Freshness(since_reset_s=5.0), 0.75),
        (Freshness(receipt_trust=0.8, connected=False), 0.4),
        (Freshness(receipt_trust=7.0), 1.0),
    ],
)
def test_index_trust(freshness: Freshness, trust: float) -> None:
    assert index_trust(freshness, W) == pytest.approx(trust)


@pytest.mark.parametrize(
    ("pressure", "p"),
    [(0.0, 1.0), (0.5, 1.0), (1.0, 0.5), (1.25, 0.25), (1.5, 0.0), (math.inf, 0.0)],
)
def test_resident_probability(pressure: float, p: float) -> None:
    assert resident_probability(pressure, 0.5) == pytest.approx(p)


def test_unknown_or_infinite_horizon_means_no_lag_risk() -> None:
    for horizon in (None, math.inf):
        s = score_replica(inp(gpu=4, horizon_s=horizon, freshness=Freshness(lag_s=1e6)),
                          100, BS, W)
        assert s.p_resident_hot == 1.0
    gone = score_replica(inp(gpu=4, horizon_s=0.0, freshness=Freshness(lag_s=1.0)), 100, BS, W)
    assert gone.p_resident_hot == 0.0


def test_point_prediction_is_the_likely_outcome() -> None:
    # the session's own tail is probably gone (P = 0.25): predict the hot prefix only
    s = score_replica(inp(gpu=6, hot_blocks=2, tail_consumed=1.25), 200, BS, W)
    assert s.predicted_cached_tokens == 2 * BS
    assert s.expected_cached_tokens == pytest.approx(BS * (2 + 4 * 0.25))
    # half-trusted index (disconnected source): still the most likely value
    half = score_replica(inp(gpu=6, freshness=Freshness(connected=False)), 200, BS, W)
    assert half.predicted_cached_tokens == 6 * BS


def test_queue_wait_counts_against_the_horizon() -> None:
    # 20k tokens queued at 20k tok/s = 1 s wait; horizon 1 s: half-way down the ramp
    idle = score_replica(inp(gpu=4, horizon_s=1.0), 100, BS, W)
    busy = score_replica(inp(gpu=4, horizon_s=1.0, queued=20000), 100, BS, W)
    assert idle.p_resident_tail == 1.0
    assert busy.wait_s == pytest.approx(1.0)
    assert busy.p_resident_tail == pytest.approx(0.5)


def test_event_lag_counts_against_the_horizon() -> None:
    s = score_replica(inp(gpu=4, horizon_s=2.0, freshness=Freshness(lag_s=2.0)), 100, BS, W)
    assert s.p_resident_hot == pytest.approx(0.5)


# ------------------------------------------------------------------------ combine_load

@pytest.mark.parametrize(
    ("kw", "queued", "decode", "known"),
    [
        (dict(own_queued_prefill_tokens=0, own_decoding=0), 0, 0, False),
        # own accounting only (stale scrape): unknown scrape is not zero
        (dict(own_queued_prefill_tokens=300, own_decoding=5), 300, 5, True),
        # one foreign waiting request at 512 tokens, 4 foreign running
        (dict(own_queued_prefill_tokens=300, own_decoding=5, foreign_waiting=1,
              foreign_running=4), 812, 9, True),
        # the scrape is 10 ms old: the foreign queue drained 200 tokens at 20k tok/s
        (dict(own_queued_prefill_tokens=300, own_decoding=5, foreign_waiting=1,
              foreign_running=0, scrape_age_s=0.01, prefill_tokens_per_s=20000), 612, 5, True),
        # long ago: the foreign backlog is gone, never negative
        (dict(own_queued_prefill_tokens=0, own_decoding=0, foreign_waiting=3,
              foreign_running=0, scrape_age_s=5, prefill_tokens_per_s=20000), 0, 0, True),
        (dict(own_queued_prefill_tokens=0, own_decoding=0, placements=-2), 0, 0, False),
    ],
)
def test_combine_load(kw: dict[str, float], queued: float, decode: float, known: bool) -> None:
    load = combine_load(foreign_prefill_tokens_per_request=512, **kw)  # type: ignore[arg-type]
    assert (load.queued_prefill_tokens, load.decode_load, load.known) == (queued, decode, known)
    assert load.placements >= 0


@pytest.mark.parametrize(
    ("waiting", "running", "queued_then", "in_flight_then", "expected"),
    [
        (None, 3, 0, 0, (None, None)),
        (0, 0, 0, 0, (0, 0)),
        # 3 waiting + 2 running, of which ours: 2 queued and 3 in flight -> 1 + 1 foreign
        (3, 2, 2, 3, (1, 1)),
        # the scrape saw fewer than we had (they finished): no foreign load
        (1, 1, 2, 4, (0, 0)),
        # ours were all running at the scrape: the waiting ones are foreign
        (2, 3, 0, 3, (2, 0)),
    ],
)
def test_foreign_load(waiting: float | None, running: float, queued_then: int,
                      in_flight_then: int, expected: tuple[float | None, float | None]) -> None:
    assert foreign_load(scraped_waiting=waiting, scraped_running=running,
                        own_queued_then=queued_then, own_in_flight_then=in_flight_then) == expected


def test_recent_placements_cost_new_conversations() -> None:
    crowded = inp(A, gpu=10, load=LoadTerms(placements=3))
    assert score_replica(crowded, 1000, BS, W).score == pytest.approx(-840 - 3 * W.delta)


# ------------------------------------------------------------------------------- pick

def test_ties_broken_by_preference_not_input_order() -> None:
    ranked = rank_replicas([inp(A), inp(B), inp(C)], 100, BS, W)
    assert [s.replica for s in pick(ranked, preference={C: 0, A: 1, B: 2})] == [C, A, B]
    assert [s.replica for s in pick(ranked, preference={B: 0})][0] == B


def test_higher_score_beats_preference() -> None:
    ranked = rank_replicas([inp(A), inp(B, gpu=2)], 100, BS, W)
    assert pick(ranked, preference={A: 0, B: 1})[0].replica == B


def test_sampling_uses_the_uniform_passed_in() -> None:
    ranked = rank_replicas([inp(A, gpu=1), inp(B)], 100, BS, W)  # scores -84, -100
    pref = {A: 0, B: 1}
    p_a = 1 / (1 + math.exp(-16 / 10))
    assert pick(ranked, preference=pref, temperature=10, u=p_a - 1e-6)[0].replica == A
    assert pick(ranked, preference=pref, temperature=10, u=p_a + 1e-6)[0].replica == B
    assert [s.replica for s in pick(ranked, preference=pref, temperature=10, u=0.99)] == [B, A]
    assert pick([], preference={}) == []


def test_hotspot_shared_prefix_everywhere_load_decides() -> None:
    # every replica holds the 50-block shared system prompt; B is the least loaded
    ranked = rank_replicas(
        [inp(A, gpu=50, queued=800), inp(B, gpu=50, queued=100), inp(C, gpu=50, queued=400)],
        1000, BS, W,
    )
    assert ranked[0].replica == B


def test_hotspot_overloaded_holder_replicates_prefix() -> None:
    # only A holds a 2000-token prefix: it wins until its queue costs more than the
    # prefix is worth, then the prefix goes to a second replica
    def best(queued_a: float) -> ReplicaId:
        ranked = rank_replicas([inp(A, gpu=125, queued=queued_a), inp(B)], 2100, BS, W)
        return pick(ranked, preference={A: 0, B: 1})[0].replica

    assert best(0) == A
    assert best(1900) == A
    assert best(2100) == B


def test_as_dict_has_every_field() -> None:
    d = score_replica(inp(gpu=1), 100, BS, W).as_dict()
    assert d["replica"] == A and d["predicted_cached_tokens"] == 16 and "score" in d


# ------------------------------------------------------------------------- properties

blocks = st.integers(min_value=0, max_value=300)
tokens = st.integers(min_value=1, max_value=6000)
loads = st.floats(min_value=0, max_value=1e6, allow_nan=False)
horizons = st.one_of(st.none(), st.floats(min_value=0, max_value=1e4, allow_nan=False))
seconds = st.floats(min_value=0, max_value=1e4, allow_nan=False)
fresh = st.builds(
    Freshness,
    lag_s=seconds,
    connected=st.booleans(),
    since_gap_s=st.one_of(st.none(), seconds),
    since_reset_s=st.one_of(st.none(), seconds),
    receipt_trust=st.floats(min_value=0, max_value=1),
)
inputs = st.builds(
    ReplicaInput,
    replica=st.just(A),
    hit=st.builds(ReplicaHit, blocks, blocks, blocks),
    load=st.builds(LoadTerms, queued_prefill_tokens=loads, decode_load=loads,
                   placements=st.floats(min_value=0, max_value=100)),
    freshness=fresh,
    horizon_s=horizons,
    free_blocks=st.one_of(st.none(), st.floats(min_value=0, max_value=1e5)),
    tail_consumed=st.floats(min_value=0, max_value=10),
    tail_queue_blocks=st.one_of(st.none(), st.floats(min_value=0, max_value=1e4)),
    tail_run_blocks=st.integers(min_value=0, max_value=600),
    hot_blocks=blocks,
)


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, st.integers(min_value=1, max_value=50),
       st.sampled_from(["gpu_blocks", "cpu_blocks", "storage_blocks"]))
def test_more_cached_blocks_never_lower_the_score(
    x: ReplicaInput, prompt: int, more: int, tier: str
) -> None:
    y = replace(x, hit=replace(x.hit, **{tier: getattr(x.hit, tier) + more}))
    assert score_replica(y, prompt, BS, W).score >= score_replica(x, prompt, BS, W).score


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, st.floats(min_value=0, max_value=1e6))
def test_more_queued_prefill_never_raises_the_score(
    x: ReplicaInput, prompt: int, more: float
) -> None:
    y = replace(x, load=replace(x.load, queued_prefill_tokens=x.load.queued_prefill_tokens + more))
    assert score_replica(y, prompt, BS, W).score <= score_replica(x, prompt, BS, W).score


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, st.floats(min_value=0, max_value=1e3))
def test_more_decode_load_never_raises_the_score(
    x: ReplicaInput, prompt: int, more: float
) -> None:
    y = replace(x, load=replace(x.load, decode_load=x.load.decode_load + more))
    assert score_replica(y, prompt, BS, W).score <= score_replica(x, prompt, BS, W).score


# Found by hypothesis: a lag over a horizon near 0 made the tail run's threshold overflow
# to infinity, and flooring it raised OverflowError (a failed request).
TINY_HORIZON = inp(gpu=4, freshness=Freshness(lag_s=10.0), horizon_s=1e-305, free_blocks=100.0,
                   tail_consumed=1.0, tail_queue_blocks=1.0, tail_run_blocks=4)


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, st.floats(min_value=0, max_value=100))
@example(TINY_HORIZON, 100, 1.0)
@example(replace(TINY_HORIZON, free_blocks=0.0, horizon_s=5e-324), 100, 1.0)
def test_more_recent_placements_never_raise_the_score(
    x: ReplicaInput, prompt: int, more: float
) -> None:
    y = replace(x, load=replace(x.load, placements=x.load.placements + more))
    assert score_replica(y, prompt, BS, W).score <= score_replica(x, prompt, BS, W).score


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, st.integers(min_value=1, max_value=50))
def test_moving_blocks_to_a_slower_tier_never_raises_the_score(
    x: ReplicaInput, prompt: int, k: int
) -> None:
    k = min(k, x.hit.gpu_blocks)
    slower = replace(x, hit=ReplicaHit(x.hit.gpu_blocks - k, x.hit.cpu_blocks + k,
                                       x.hit.storage_blocks))
    assert score_replica(slower, prompt, BS, W).score <= score_replica(x, prompt, BS, W).score


@settings(max_examples=300, deadline=None)
@given(inputs, tokens, seconds, seconds)
def test_staleness_and_age_never_raise_the_score(
    x: ReplicaInput, prompt: int, more_lag: float, more_age: float
) -> None:
    base = score_replica(x, prompt, BS, W).score
    lagged = replace(x, freshness=replace(x.freshness, lag_s=x.freshness.lag_s + more_lag))
    older = replace(x, tail_consumed=x.tail_consumed + more_age)
    down = replace(x, freshness=replace(x.freshness, connected=False))
    assert score_replica(lagged, prompt, BS, W).score <= base
    assert score_replica(older, prompt, BS, W).score <= base
    assert score_replica(down, prompt, BS, W).score <= base


@settings(max_examples=300, deadline=None)
@given(inputs, tokens)
def test_predictions_stay_within_the_usable_match(x: ReplicaInput, prompt: int) -> None:
    s = score_replica(x, prompt, BS, W)
    held = s.usable_blocks * BS
    assert s.usable_blocks <= min(x.hit.blocks, max(0, (prompt - 1) // BS))
    assert 0 <= s.expected_cached_tokens <= held + 1e-6
    assert 0 <= s.predicted_cached_tokens <= held and s.predicted_cached_tokens % BS == 0
    if s.p_index == 1.0 and s.p_resident_tail == 1.0:
        assert s.predicted_cached_tokens == held
    assert 0 <= s.p_index <= 1 and 0 <= s.p_resident_tail <= s.p_resident_hot <= 1


@settings(max_examples=200, deadline=None)
@given(st.lists(inputs, min_size=1, max_size=8), tokens, st.floats(min_value=0, max_value=1))
def test_rank_and_pick_are_permutations(xs: list[ReplicaInput], prompt: int, u: float) -> None:
    xs = [replace(x, replica=ReplicaId(f"r{i}")) for i, x in enumerate(xs)]
    ranked = rank_replicas(xs, prompt, BS, W)
    assert [s.score for s in ranked] == sorted((s.score for s in ranked), reverse=True)
    for temperature in (0.0, 50.0):
        picked = pick(ranked, preference={}, temperature=temperature, u=u)
        assert sorted(s.replica for s in picked) == sorted(x.replica for x in xs)


# Every float the documented ranges allow, down to subnormals and up to the largest finite
# values: the score is on the request path, so it must never raise or return NaN.
anything = st.floats(min_value=0, allow_infinity=False, allow_nan=False)
tiny_or_huge = st.one_of(anything, st.floats(min_value=0, max_value=1e-300),
                         st.sampled_from([0.0, 5e-324, 1e-305, 1e305, 1.7e308]))
extreme_inputs = st.builds(
    ReplicaInput,
    replica=st.just(A),
    hit=st.builds(ReplicaHit, blocks, blocks, blocks),
    load=st.builds(LoadTerms, queued_prefill_tokens=tiny_or_huge, decode_load=tiny_or_huge,
                   placements=tiny_or_huge),
    freshness=st.builds(Freshness, lag_s=tiny_or_huge, connected=st.booleans(),
                        since_gap_s=st.one_of(st.none(), tiny_or_huge),
                        since_reset_s=st.one_of(st.none(), tiny_or_huge),
                        receipt_trust=st.floats(min_value=0, max_value=1)),
    horizon_s=st.one_of(st.none(), tiny_or_huge),
    free_blocks=st.one_of(st.none(), tiny_or_huge),
    tail_consumed=tiny_or_huge,
    tail_queue_blocks=st.one_of(st.none(), tiny_or_huge),
    tail_run_blocks=st.integers(min_value=0, max_value=10**6),
    hot_blocks=blocks,
    costs=st.builds(CostModel, kv_bytes_per_token=tiny_or_huge,
                    prefill_tokens_per_s=tiny_or_huge,
                    cpu_bandwidth_bytes_per_s=tiny_or_huge,
                    storage_bandwidth_bytes_per_s=tiny_or_huge),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(extreme_inputs, min_size=1, max_size=3), tokens,
       st.floats(min_value=0, max_value=1), st.one_of(st.just(0.0), tiny_or_huge),
       st.floats(min_value=0, max_value=1))
@example([TINY_HORIZON], 100, 0.5, 0.0, 0.0)
def test_scoring_never_raises_or_returns_nan_on_finite_inputs(
    xs: list[ReplicaInput], prompt: int, spread: float, temperature: float, u: float
) -> None:
    w = replace(W, horizon_spread=spread)
    ranked = rank_replicas(xs, prompt, BS, w)
    for s in ranked:
        assert not any(math.isnan(v) for v in s.as_dict().values() if isinstance(v, float)), s
        assert 0 <= s.expected_cached_tokens <= s.usable_blocks * BS + 1e-6
        assert 0 <= s.predicted_cached_tokens <= s.usable_blocks * BS
        assert 0 <= s.p_resident_tail <= s.p_resident_hot <= 1
    assert len(pick(ranked, preference={}, temperature=temperature, u=u)) == len(xs)


def test_rescored_is_replace_with_another_score() -> None:
    """``ReplicaScore.rescored`` (pricing's fast copy) equals ``dataclasses.replace``,
    whatever the fields hold."""
    import dataclasses

    values: dict[str, object] = {f.name: i + 0.5 for i, f in
                                 enumerate(dataclasses.fields(ReplicaScore))}
    values.update(replica=ReplicaId("r7"), load_known=False)
    s = ReplicaScore(**values)  # type: ignore[arg-type]
    assert s.rescored(-3.25) == replace(s, score=-3.25)
    assert s.rescored(-3.25).as_dict() == {**s.as_dict(), "score": -3.25}
