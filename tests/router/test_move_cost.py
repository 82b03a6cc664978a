"""Pricing a conversation's move by what it costs the fleet (``router.move_cost``)."""

from __future__ import annotations

import pytest

from kvkeys.types import ReplicaId
from router.move_cost import (
    MAX_BUSY,
    FleetState,
    busy_share,
    move_cost,
    price_moves,
    price_placement,
)
from tests.router.helpers import replica_score as score

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def test_busy_share_from_measured_allocations_and_configured_rate() -> None:
    # 250 blocks/s of 16 tokens on a replica that prefills 20,000 tokens/s: 20% busy.
    assert busy_share(250.0, 16, 20_000.0) == pytest.approx(0.2)
    assert busy_share(10_000.0, 16, 20_000.0) == MAX_BUSY
    assert busy_share(None, 16, 20_000.0) is None


def test_move_cost_adds_queueing_and_both_caches() -> None:
    # 448 tokens of context moved onto a 50%-busy target (each token delays others by
    # 0.5 / 0.5 = 1 more), displacing blocks reused 3/4 of the time there and stranding
    # blocks reused half the time at the origin: 448 x (1 + 0.75 + 0.5).
    cost = move_cost(448, FleetState(busy=0.5, reuse=0.75), FleetState(reuse=0.5))
    assert cost == pytest.approx(448 * 2.25)
    assert move_cost(0, FleetState(busy=0.5), FleetState()) == 0.0
    assert move_cost(100, FleetState(), FleetState()) == 0.0  # nothing measured: free


def test_a_transient_queue_no_longer_moves_a_conversation_with_context() -> None:
    # The request's own view: staying on A (448 cached, 1,700 queued) scores -1,800,
    # moving to B (nothing cached, no queue) -548: it would move.  The fleet pays 448
    # x (1 + 1 + 1) = 1,344 more for the move on a 50%-busy target with reused caches.
    ranked = [score(B, 0.0, -548.0), score(A, 448.0, -1800.0)]
    states = {A: FleetState(busy=0.5, reuse=1.0), B: FleetState(busy=0.5, reuse=1.0)}
    out, costs = price_moves(ranked, A, states, alpha=1.0)
    assert [s.replica for s in out] == [A, B]
    assert costs == {B: pytest.approx(448 * 3)}
    # A queue larger than the fleet's loss still moves it.
    ranked = [score(B, 0.0, -548.0), score(A, 448.0, -3000.0)]
    assert price_moves(ranked, A, states, alpha=1.0)[0][0].replica == B


def test_new_conversations_and_origins_without_context_are_not_charged() -> None:
    ranked = [score(B, 0.0, -10.0), score(A, 0.0, -20.0)]
    states = {A: FleetState(busy=0.9, reuse=1.0), B: FleetState(busy=0.9, reuse=1.0)}
    assert price_moves(ranked, None, states, 1.0) == (ranked, {})
    assert price_moves(ranked, A, states, 1.0) == (ranked, {})


def test_reuse_share_is_learnt_from_returns_within_the_horizon() -> None:
    from router.affinity import AffinityKey
    from router.horizon import HorizonEstimator, PoolSample
    from router.policy import RouteRequest
    from router.receipts import ReceiptCalibration
    from router.session_table import SessionTable
    from router.session_tracker import SessionTracker

    horizon = HorizonEstimator(tau_s=30.0, stale_s=1e9)
    for t, computed in ((0.0, 0.0), (1.0, 1600.0)):  # 100 blocks/s, 750 free: 7.5 s
        horizon.observe_scrape(A, PoolSample(t=t, block_size=16, num_gpu_blocks=1000,
                                             kv_usage=0.25, computed_prompt_tokens_total=computed,
                                             generation_tokens_total=0.0))
    tracker = SessionTracker(sessions=SessionTable(), horizon=horizon,
                             calibration=ReceiptCalibration(), metrics=None, policy_name="kv",
                             detect_prefix_breaks=False, receipt_large_abs_tokens=64,
                             receipt_large_rel=0.1)
    assert tracker.reuse_share(A) is None
    key = AffinityKey("s", "session")
    request = RouteRequest("q", "chat", "/v1/chat/completions", "m", {}, "s")
    now = 1.0
    for think in (1.0, 2.0, 30.0):  # two returns within 7.5 s, one beyond
        tracker.turn(request, key, A, None, now)
        tracker.finished("s", A, None, now)
        now += think
    tracker.turn(request, key, A, None, now)
    assert tracker.reuse_share(A) == pytest.approx((2 + 1) / (3 + 2))
    assert tracker.reuse_share(B) is None


def test_a_new_conversation_goes_where_the_cache_is_lost_anyway() -> None:
    # Equal scores (only a shared prompt, no queue): A's cache serves 90% of its
    # returning conversations, B's 10%.  A conversation holding 3,200 tokens displaces
    # 3,200 x 0.9 reusable tokens on A, 3,200 x 0.1 on B: it goes to B.
    ranked = [score(A, 1504.0, -150.0), score(B, 1504.0, -150.0)]
    states = {A: FleetState(reuse=0.9), B: FleetState(reuse=0.1)}
    out, costs = price_placement(ranked, states, 3200.0, alpha=1.0)
    assert [s.replica for s in out] == [B, A]
    assert costs == {A: pytest.approx(2880.0), B: pytest.approx(320.0)}
    assert out[0].score == pytest.approx(-150.0 - 320.0)
    # A queue on B larger than the cache A would lose still sends it to A.
    ranked = [score(A, 1504.0, -150.0), score(B, 1504.0, -150.0 - 3000.0)]
    assert price_placement(ranked, states, 3200.0, alpha=1.0)[0][0].replica == A


def test_a_placement_is_free_while_footprint_or_reuse_is_unknown() -> None:
    ranked = [score(B, 0.0, -10.0), score(A, 0.0, -20.0), score(C, 0.0, -30.0)]
    states = {A: FleetState(reuse=1.0), B: FleetState(), C: FleetState(reuse=0.0)}
    assert price_placement(ranked, states, None, 1.0) == (ranked, {})
    out, costs = price_placement(ranked, states, 100.0, 1.0)
    assert costs == {A: pytest.approx(100.0)}  # B unknown, C never reused: free
    assert [s.replica for s in out] == [B, C, A]


def test_footprint_is_the_mean_context_a_session_turn_leaves() -> None:
    from router.horizon import HorizonEstimator
    from router.receipts import ReceiptCalibration
    from router.session_table import SessionTable
    from router.session_tracker import SessionTracker

    tracker = SessionTracker(sessions=SessionTable(), horizon=HorizonEstimator(),
                             calibration=ReceiptCalibration(), metrics=None, policy_name="kv",
                             detect_prefix_breaks=False, receipt_large_abs_tokens=64,
                             receipt_large_rel=0.1)
    assert tracker.footprint_blocks() is None
    tracker.finished(None, A, 500, 1.0)  # not a conversation: not counted
    tracker.finished("s", A, None, 1.0)  # size unknown: not counted
    assert tracker.footprint_blocks() is None
    tracker.finished("s", A, 100, 2.0)
    tracker.finished("t", B, 300, 3.0)
    assert tracker.footprint_blocks() == pytest.approx(200.0)
