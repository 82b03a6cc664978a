"""The kv policy's look ahead: think times, displaced and retained context, pool headroom
and the tail allowance (``router.think_times``, ``router.displacement``,
``router.idle_runs``, ``router.fleet_outlook``)."""

from __future__ import annotations

import random

import pytest

from kvkeys.types import ReplicaId
from prompt.keyer import Prompt
from router.displacement import (
    GRID,
    IdleRun,
    displaced_blocks,
    displacement_curve,
    interpolate,
    retained_blocks,
)
from router.fleet_outlook import FleetOutlook, OutlookSettings
from router.horizon import HorizonEstimator, PoolSample
from router.idle_runs import IdleRuns
from router.service_times import ServiceTimes
from router.think_times import BUCKET_S, SETTLE_QUANTILE, Returning, ThinkTimes
from tests.router.helpers import replica_score as score

A, B = ReplicaId("a"), ReplicaId("b")


def _prompt(tokens: int) -> Prompt:
    return Prompt(token_ids=[1] * tokens, block_keys=[], block_size=16, model="m")


# ---------------------------------------------------------------- think times
def test_return_share_counts_only_pauses_old_enough_to_have_come_back() -> None:
    tt = ThinkTimes()
    assert tt.return_share(0.0) is None
    # Ten pauses start at t=0; nine come back after 20 s, one never does.
    for _ in range(10):
        tt.paused(0.0)
    for _ in range(9):
        tt.returned(20.0, 20.0)
    # Too early: the bucket of t=0 is younger than the longest think time plus a bucket.
    assert tt.return_share(20.0) is None
    share = tt.return_share(20.0 + 2 * BUCKET_S)
    assert share == pytest.approx((9 + 1) / (10 + 2))


def _recount(tt: ThinkTimes, now: float) -> float | None:
    """The return share recounted over every kept bucket (the definition)."""
    thinks = sorted(tt._recent)
    if not thinks:
        return None
    longest = thinks[min(len(thinks) - 1, int(SETTLE_QUANTILE * len(thinks)))]
    settled = int((now - longest) // BUCKET_S) - 1
    counts = [c for key, c in tt._buckets.items() if key <= settled]
    started = sum(n for n, _ in counts)
    if started == 0:
        return None
    return (sum(r for _, r in counts) + 1) / (started + 2)


@pytest.mark.parametrize("max_buckets", [3, 40, 2048])
def test_return_share_equals_a_recount_at_any_uptime(max_buckets: int) -> None:
    # The share is kept as running sums less the unsettled buckets, so that its cost
    # does not grow with uptime; it must equal a recount over the kept buckets, also
    # once old buckets have been dropped.
    rng = random.Random(max_buckets)
    tt = ThinkTimes(max_buckets=max_buckets, max_samples=64)
    events: list[tuple[float, float | None]] = []  # (when, think time of a return)
    t = 0.0
    for _ in range(1500):
        t += rng.expovariate(0.5)
        events.append((t, None))
        if rng.random() < 0.4:
            wait = rng.uniform(1.0, 120.0)
            events.append((t + wait, wait))
    for now, think in sorted(events, key=lambda e: e[0]):
        if think is None:
            tt.paused(now)
        else:
            tt.returned(think, now)
        for later in (now, now + 60.0, now + 300.0):
            assert tt.return_share(later) == _recount(tt, later)


def test_returning_conditions_on_the_time_already_paused() -> None:
    tt = ThinkTimes(points=4)
    for t in (10.0, 20.0, 30.0, 40.0):
        tt.paused(0.0)
        tt.returned(t, t)
    # Everyone comes back (share 1): paused 25 s, the returns left are at 30 and 40 s.
    out = tt.returning(25.0, 1.0)
    assert out is not None and out.p == pytest.approx(1.0)
    assert out.waits == pytest.approx((5.0, 15.0))
    # Half the pauses never end in a return: as many "never" as returns in the sample,
    # so past 25 s the two later returns face four nevers.
    half = tt.returning(25.0, 0.5)
    assert half is not None and half.p == pytest.approx(2 / 6)
    assert tt.returning(45.0, 1.0) == Returning(0.0, ())
    assert tt.returning(0.0, None) is None


def test_think_time_sample_is_bounded() -> None:
    tt = ThinkTimes(max_samples=3, points=8)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        tt.returned(t, 100.0)
    out = tt.returning(0.0, 1.0)
    assert out is not None and out.waits == (3.0, 4.0, 5.0)


# ---------------------------------------------------------------- displacement
def test_displaced_blocks_counts_what_a_returning_session_no_longer_finds() -> None:
    # A 100-block run whose first block survives 150 more allocations; the session
    # comes back for sure after 1 s, and the replica allocates 10 blocks a second.
    run = IdleRun(depth=150.0, run=100, elapsed_s=5.0)
    sure = lambda elapsed: Returning(1.0, (1.0,))  # noqa: E731
    # Without the placement it finds min(100, 150 - 10) = 100 blocks; allocating 80
    # now leaves 60: 40 lost.
    assert displaced_blocks([run], 80.0, 10.0, sure) == pytest.approx(40.0)
    # A deep pool: nothing lost.
    deep = IdleRun(depth=1_000.0, run=100, elapsed_s=5.0)
    assert displaced_blocks([deep], 80.0, 10.0, sure) == 0.0
    # A session that will not come back costs nothing, nor does one that comes back
    # only after its run is gone anyway.
    never = lambda elapsed: Returning(0.0, ())  # noqa: E731
    late = lambda elapsed: Returning(1.0, (20.0,))  # noqa: E731
    assert displaced_blocks([run], 80.0, 10.0, never) == 0.0
    assert displaced_blocks([run], 80.0, 10.0, late) == 0.0
    # Weighed by the chance it comes back at all.
    maybe = lambda elapsed: Returning(0.5, (1.0,))  # noqa: E731
    assert displaced_blocks([run], 80.0, 10.0, maybe) == pytest.approx(20.0)


def test_retained_blocks_is_what_the_conversation_keeps_until_it_returns() -> None:
    back_in_10s = Returning(1.0, (10.0,))
    # 50 blocks released behind 200 free ones: a replica allocating 10 blocks/s has
    # consumed 100 by the return (all kept), one allocating 22/s has consumed 220
    # (the run's tail: 30 of 50 kept).
    assert retained_blocks(50.0, 200.0, 10.0, back_in_10s) == pytest.approx(50.0)
    assert retained_blocks(50.0, 200.0, 22.0, back_in_10s) == pytest.approx(30.0)
    assert retained_blocks(50.0, 200.0, 100.0, back_in_10s) == 0.0
    assert retained_blocks(50.0, 200.0, 10.0, None) == 0.0


# ---------------------------------------------------------------- idle runs
def test_idle_runs_drop_evicted_runs_and_resumed_sessions() -> None:
    runs = IdleRuns(max_runs=3)
    runs.paused("s1", A, alloc_mark=0.0, free_mark=10.0, blocks=5, now=0.0)
    runs.paused("s2", A, alloc_mark=0.0, free_mark=100.0, blocks=5, now=1.0)
    runs.paused("s3", B, alloc_mark=0.0, free_mark=100.0, blocks=5, now=1.0)
    assert [r.depth for r in runs.runs(A, 0.0, 2.0)] == [15.0, 105.0]
    # After 20 allocations s1's run (depth 15) is gone and dropped for good.
    assert [r.depth for r in runs.runs(A, 20.0, 2.0)] == [85.0]
    assert len(runs) == 2
    assert list(runs.runs(A, 20.0, 2.0, exclude="s2")) == []
    runs.resumed("s2")
    assert list(runs.runs(A, 0.0, 2.0)) == []
    runs.forget_replica(B)
    assert len(runs) == 0


def test_idle_runs_are_bounded_per_replica() -> None:
    runs = IdleRuns(max_runs=2)
    for i in range(5):
        runs.paused(f"s{i}", A, alloc_mark=0.0, free_mark=100.0, blocks=1, now=float(i))
    assert len(runs) == 2
    assert [r.elapsed_s for r in runs.runs(A, 0.0, 10.0)] == [7.0, 6.0]


# ---------------------------------------------------------------- the outlook
def _pin(out: FleetOutlook, request_id: str, blocks: float, now: float) -> None:
    """Route a request pinning ``blocks`` blocks on A (16 tokens each, no reply learnt)."""
    out.routed(request_id, None, A, _prompt(int(blocks * 16)), [], None, now)


def _horizon(pool: int = 1000, usage: float = 0.0) -> HorizonEstimator:
    h = HorizonEstimator()
    for r in (A, B):
        h.observe_scrape(r, PoolSample(t=0.0, block_size=16, num_gpu_blocks=pool,
                                       kv_usage=usage, computed_prompt_tokens_total=None,
                                       generation_tokens_total=None))
    return h


def test_pool_headroom_charges_the_wait_for_memory() -> None:
    h = _horizon(pool=100)
    out = FleetOutlook(h, OutlookSettings(future_weight=0.0, stay_quantile=None),
                       prefill_tokens_per_s=1000.0, alpha=1.0, beta=1.0)
    # One request of 80 blocks in flight on A; service time learnt from one that took 2 s.
    _pin(out, "old", 10.0, 0.0)
    out.finished("old", None, A, None, None, None, 2.0)
    _pin(out, "r1", 80.0, 2.0)
    # A 50-block prompt (16 tokens per block) does not fit beside it on A: it waits for
    # the one request in flight, about a service time (2 s = 2,000 tokens); B is empty.
    ranked = out.price([score(A, 0.0, -800.0), score(B, 0.0, -800.0)],
                       _prompt(800), None, None, 2.0)
    assert [s.replica for s in ranked] == [B, A]
    assert ranked[1].score == pytest.approx(-800.0 - 2000.0)
    out.finished("r1", None, A, None, None, None, 4.0)
    ranked = out.price([score(A, 0.0, -800.0), score(B, 0.0, -800.0)],
                       _prompt(800), None, None, 4.0)
    assert [s.score for s in ranked] == [-800.0, -800.0]


def test_service_times_give_the_mean_residual_of_what_was_seen() -> None:
    st = ServiceTimes()
    assert st.remaining(0.0) is None
    for seconds in (1.0, 2.0, 3.0, 10.0):
        st.observe(seconds)
    assert st.remaining(0.0) == pytest.approx(4.0)  # the mean
    assert st.remaining(2.5) == pytest.approx((3.0 + 10.0) / 2 - 2.5)  # 4: the long tail
    assert st.remaining(9.0) == pytest.approx(1.0)
    assert st.remaining(20.0) == 0.0  # past everything seen
    for _ in range(300):  # bounded: the newest samples only
        st.observe(1.0)
    assert len(st) == 256 and st.remaining(0.0) == pytest.approx(1.0)


def test_pool_wait_is_shorter_where_the_request_in_flight_is_about_to_finish() -> None:
    h = _horizon(pool=100)
    for r in (A, B):
        h.observe_scrape(r, PoolSample(t=0.0, block_size=16, num_gpu_blocks=100, kv_usage=0.0,
                                       computed_prompt_tokens_total=None,
                                       generation_tokens_total=None))
    out = FleetOutlook(h, OutlookSettings(future_weight=0.0, stay_quantile=None),
                       prefill_tokens_per_s=1000.0, alpha=1.0, beta=1.0)
    for i in range(8):  # every request so far took 4 s
        _pin(out, f"old{i}", 10.0, 0.0)
        out.finished(f"old{i}", None, A, None, None, None, 4.0)
    # 80 blocks in flight on each: A's since 3.5 s ago, B's just sent.
    out.routed("a1", None, A, _prompt(80 * 16), [], None, 4.0)
    out.routed("b1", None, B, _prompt(80 * 16), [], None, 7.5)
    ranked = out.price([score(B, 0.0, -800.0), score(A, 0.0, -800.0)],
                       _prompt(800), None, None, 7.5)
    # A frees its blocks in about 0.5 s (500 tokens), B in about 4 s (4,000 tokens).
    assert [s.replica for s in ranked] == [A, B]
    assert ranked[0].score == pytest.approx(-800.0 - 500.0)
    assert ranked[1].score == pytest.approx(-800.0 - 4000.0)


def test_a_later_turn_may_queue_at_home_up_to_the_recent_ttft_quantile() -> None:
    h = _horizon()
    out = FleetOutlook(h, OutlookSettings(future_weight=0.0, stay_quantile=0.5,
                                          pool_headroom=False),
                       prefill_tokens_per_s=1000.0, alpha=1.0, beta=1.0)
    for i in range(40):
        _pin(out, f"r{i}", 1.0, 0.0)
        out.finished(f"r{i}", None, A, None, 0.1 if i % 2 else 0.3, None, 1.0)
    # Median TTFT 0.1 s = 100 tokens of allowance: home (holding 400 tokens of context,
    # 300 queued) gets 100 of its queue back; the other replica gets nothing.
    ranked = out.price([score(B, 100.0, -500.0), score(A, 400.0, -550.0, queued=300.0)],
                       _prompt(500), "s", A, 1.0)
    assert {s.replica: s.score for s in ranked} == {A: -450.0, B: -500.0}
    # Without context at home beyond the shared prefix, no allowance.
    ranked = out.price([score(B, 100.0, -500.0), score(A, 100.0, -550.0, queued=300.0)],
                       _prompt(500), "s", A, 1.0)
    assert {s.replica: s.score for s in ranked} == {A: -550.0, B: -500.0}


def _displacing_outlook(horizon: HorizonEstimator | None = None) -> FleetOutlook:
    """Displacement and retention only, with think times learnt: sessions come back
    after 5 s, every time."""
    out = FleetOutlook(horizon or _horizon(pool=1000, usage=0.0),
                       OutlookSettings(future_weight=1.0, stay_quantile=None,
                                       pool_headroom=False),
                       prefill_tokens_per_s=1000.0, alpha=1.0, beta=1.0)
    for _ in range(20):
        out.think_times.paused(0.0)
        out.think_times.returned(5.0, 5.0)
    return out


def test_placement_goes_where_it_displaces_no_returning_context() -> None:
    out = _displacing_outlook()
    # A paused session on A, right at the head of its LRU queue (depth 60 of a 50-block
    # run): any large allocation on A evicts the context it comes back for.
    out.idle_runs.paused("other", A, alloc_mark=0.0, free_mark=10.0, blocks=50, now=99.0)
    ranked = out.price([score(A, 0.0, -2048.0), score(B, 0.0, -2048.0)],
                       _prompt(2048), "new", None, 100.0)
    assert ranked[0].replica == B
    cost = {s.replica: s.score for s in ranked}
    # On A the 128 new blocks evict all 50 of the other session's (50 x 16 tokens),
    # weighed by the learnt return share (21 / 22, Laplace-smoothed); both replicas
    # credit the conversation's own retained context alike.
    assert cost[B] - cost[A] == pytest.approx(50 * 16 * 21 / 22)


def test_the_displacement_curve_matches_the_exact_loss_at_its_grid_points() -> None:
    runs = [IdleRun(depth=60.0, run=50, elapsed_s=1.0), IdleRun(depth=300.0, run=80,
                                                               elapsed_s=3.0)]
    some = lambda elapsed: Returning(0.8, (0.5, 2.0, 6.0))  # noqa: E731
    curve = displacement_curve(runs, 20.0, some)
    for x, value in zip(GRID, curve, strict=True):
        assert value == pytest.approx(displaced_blocks(runs, x, 20.0, some))
    # Between grid points: the chord, between its neighbours (the loss grows with x).
    assert curve[2] <= interpolate(GRID, curve, 100.0) <= curve[3]
    assert interpolate(GRID, curve, 1e9) == curve[-1]


def test_a_stay_is_not_charged_for_displacing_its_own_paused_run() -> None:
    out = _displacing_outlook()
    out.idle_runs.paused("me", A, alloc_mark=0.0, free_mark=10.0, blocks=50, now=99.0)
    ranked = out.price([score(A, 800.0, -1248.0), score(B, 800.0, -1248.0)],
                       _prompt(2048), "me", A, 100.0)
    # Both replicas credit the same retained context; A is not charged for "evicting"
    # the run its own turn re-uses.
    scores = {s.replica: s.score for s in ranked}
    assert scores[A] == pytest.approx(scores[B])


def test_no_retained_credit_unless_every_replica_pool_is_known() -> None:
    horizon = _horizon(pool=1000, usage=0.0)
    out = _displacing_outlook(horizon)
    # B's scrape goes stale (only A is scraped again, long after): A's pool is known,
    # B's is not, so neither is credited what the conversation would keep there.
    late = 100.0
    horizon.observe_scrape(A, PoolSample(
        t=late, block_size=16, num_gpu_blocks=1000, kv_usage=0.0,
        computed_prompt_tokens_total=None, generation_tokens_total=None))
    ranked = out.price([score(A, 96.0, -168.0), score(B, 192.0, -72.0)],
                       _prompt(264), "s", B, late)
    assert {s.replica: s.score for s in ranked} == {A: -168.0, B: -72.0}
