"""Eviction horizon from scraped pool size and allocation rate."""

from __future__ import annotations

import math

import pytest

from kvkeys.types import ReplicaId
from router.horizon import HorizonEstimator, PoolSample, classify_return

A = ReplicaId("a")


def sample(t: float, computed: float, gen: float, usage: float = 0.25,
           blocks: int = 1000) -> PoolSample:
    return PoolSample(t=t, block_size=16, num_gpu_blocks=blocks, kv_usage=usage,
                      computed_prompt_tokens_total=computed, generation_tokens_total=gen)


def test_horizon_is_free_blocks_over_allocation_rate() -> None:
    h = HorizonEstimator(tau_s=30.0)
    assert h.horizon_s(A, 0.0) is None
    h.observe_scrape(A, sample(0.0, 0, 0))
    assert h.horizon_s(A, 0.0) is None  # no rate yet
    # 1 s later: 1600 computed prompt tokens + 160 generated = 110 blocks/s
    h.observe_scrape(A, sample(1.0, 1600, 160))
    assert h.allocation_rate(A) == pytest.approx(110.0)
    assert h.horizon_s(A, 1.0) == pytest.approx(750 / 110)


def test_no_churn_means_infinite_and_stale_means_unknown() -> None:
    h = HorizonEstimator(stale_s=5.0)
    h.observe_scrape(A, sample(0.0, 100, 0))
    h.observe_scrape(A, sample(1.0, 100, 0))
    assert h.horizon_s(A, 1.0) == math.inf
    assert h.horizon_s(A, 7.0) is None


def test_rate_is_smoothed_and_counter_resets_are_skipped() -> None:
    h = HorizonEstimator(tau_s=10.0)
    h.observe_scrape(A, sample(0.0, 0, 0))
    h.observe_scrape(A, sample(1.0, 1600, 0))  # 100 blocks/s
    h.observe_scrape(A, sample(2.0, 0, 0))  # restart: reset, not negative
    rate = h.allocation_rate(A)
    assert rate is not None and 0 < rate < 100
    h.observe_scrape(A, sample(2.2, 160, 0))  # under min_dt: accumulated, not applied
    assert h.allocation_rate(A) == rate
    h.forget(A)
    assert h.allocation_rate(A) is None


def test_events_can_feed_the_rate() -> None:
    h = HorizonEstimator()
    h.observe_allocated(A, 0.0, 5)
    h.observe_allocated(A, 2.0, 40)
    assert h.allocation_rate(A) == pytest.approx(20.0)
    h.observe_scrape(A, PoolSample(2.0, None, 100, 0.5, None, None))
    assert h.horizon_s(A, 2.0) == pytest.approx(50 / 20)


@pytest.mark.parametrize(("think", "horizon", "outcome"),
                         [(5.0, 10.0, "within_horizon"), (50.0, 10.0, "beyond_horizon"),
                          (5.0, None, "unknown"), (1e9, math.inf, "within_horizon")])
def test_classify_return(think: float, horizon: float | None, outcome: str) -> None:
    assert classify_return(think, horizon) == outcome


def test_allocation_count_and_free_pool_for_lru_marks() -> None:
    h = HorizonEstimator(stale_s=5.0)
    h.observe_allocated(A, 0.0, 10)
    h.observe_allocated(A, 1.0, 30)
    assert h.allocated(A) == 40 and h.allocated(ReplicaId("x")) == 0
    assert h.free_blocks(A, 1.0) is None
    h.observe_scrape(A, sample(1.0, 160, 0, usage=0.5), count_allocations=False)
    assert h.allocated(A) == 40  # events already count them
    assert h.free_blocks(A, 1.0) == 500 and h.free_blocks(A, 7.0) is None
    h.observe_scrape(A, sample(2.0, 320, 0, usage=0.5))
    assert h.allocated(A) == 50


def test_free_pool_is_carried_forward_between_scrapes() -> None:
    h = HorizonEstimator(stale_s=5.0)
    h.observe_allocated(A, 0.0, 40)  # before the scrape: already in its snapshot
    h.observe_released(A, 25)
    h.observe_scrape(A, sample(1.0, 0, 0, usage=0.9), count_allocations=False)
    assert h.free_blocks(A, 1.0) == pytest.approx(100)
    # Since the scrape: three turns finished (their blocks return to the free queue),
    # 20 blocks were newly allocated.
    for _ in range(3):
        h.observe_released(A, 40)
    h.observe_allocated(A, 1.5, 20)
    assert h.free_blocks(A, 1.5) == pytest.approx(100 + 120 - 20)
    # bounded by the pool, never negative
    h.observe_released(A, 5000)
    assert h.free_blocks(A, 1.6) == 1000
    h.observe_allocated(A, 1.7, 9000)
    assert h.free_blocks(A, 1.7) == 0
    # the next scrape is the new baseline
    h.observe_scrape(A, sample(2.0, 0, 0, usage=0.5), count_allocations=False)
    assert h.free_blocks(A, 2.0) == pytest.approx(500)
    h.observe_released(A, -5)  # nonsense is ignored
    assert h.free_blocks(A, 2.0) == pytest.approx(500)
    assert h.free_blocks(A, 8.0) is None  # stale


def test_scrape_counted_allocations_are_in_the_snapshot() -> None:
    h = HorizonEstimator()
    h.observe_scrape(A, sample(0.0, 0, 0, usage=0.5))
    h.observe_scrape(A, sample(1.0, 1600, 0, usage=0.6))  # 100 blocks, in this snapshot
    assert h.free_blocks(A, 1.0) == pytest.approx(400)
