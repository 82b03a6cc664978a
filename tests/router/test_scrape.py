"""The /metrics scraper: the parser on vLLM's exposition, and live scrapes of a sim."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvkeys.types import ReplicaId
from replica.sim.server import SimHandle, start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.horizon import HorizonEstimator, PoolSample
from router.scrape import MetricsScraper, ScrapeSample, parse_vllm_metrics
from tests.ports import free_port

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 500.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1500.0
vllm:generation_tokens_total{engine="0",model_name="m"} 77.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="1000"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""


def test_parse_sums_engines_and_derives_computed_tokens() -> None:
    s = parse_vllm_metrics(VLLM_TEXT, 5.0)
    assert (s.t, s.waiting, s.running) == (5.0, 4.0, 5.0)
    assert s.kv_usage == pytest.approx(0.375)
    assert (s.block_size, s.num_gpu_blocks) == (16, 2000)
    assert s.prompt_tokens_total == 1500 and s.computed_prompt_tokens_total == 900
    assert s.prefix_cache_queries_total == 1500 and s.generation_tokens_total == 77


def test_parse_prefers_local_compute_and_old_names() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{engine="0"} 0.75\n'
        'vllm:prompt_tokens_total 100\n'
        'vllm:gpu_prefix_cache_hits_total 10\n'
        'vllm:prompt_tokens_by_source_total{source="local_compute",engine="0"} 42\n'
        'vllm:prompt_tokens_by_source_total{source="local_cache_hit",engine="0"} 58\n'
        'vllm:num_requests_waiting garbage\n'
        'vllm:cache_config_info{block_size="x"} 1\n'
        "other_metric 1\n"
    )
    s = parse_vllm_metrics(text, 0.0)
    assert s.kv_usage == 0.75 and s.prefix_cache_hits_total == 10
    assert s.computed_prompt_tokens_total == 42
    assert s.waiting is None and s.block_size is None
    empty = parse_vllm_metrics("", 0.0)
    assert empty == ScrapeSample(t=0.0)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


@pytest.fixture
async def sim(tokenizer_dir: Path) -> AsyncIterator[SimHandle]:
    async with start_sim(tokenizer_dir, model="m", num_blocks=512, time_scale=0.01) as h:
        yield h


async def test_scrapes_a_live_sim_and_marks_stale_and_failed(sim: SimHandle) -> None:
    now = [100.0]
    dead = f"http://127.0.0.1:{free_port()}"
    a, b = ReplicaId("a"), ReplicaId("b")
    horizon = HorizonEstimator()
    seen: list[ScrapeSample] = []
    async with aiohttp.ClientSession() as http:
        scraper = MetricsScraper(http, lambda: [(a, sim.url), (b, dead)], clock=lambda: now[0],
                                 timeout_s=1.0, stale_after_s=3.0)
        scraper.add_listener(lambda r, s: seen.append(s))
        scraper.add_listener(lambda r, s: horizon.observe_scrape(r, PoolSample(
            s.t, s.block_size, s.num_gpu_blocks, s.kv_usage, s.computed_prompt_tokens_total,
            s.generation_tokens_total)))
        await scraper.scrape_once()
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}],
                "max_tokens": 4}
        async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        now[0] += 1.0
        await scraper.scrape_once()
    sample = scraper.latest(a, now[0])
    assert sample is not None and sample.block_size == 16 and sample.num_gpu_blocks == 512
    assert sample.waiting == 0 and sample.running == 0 and sample.kv_usage == 0
    assert (sample.prompt_tokens_total or 0) > 40 and (sample.generation_tokens_total or 0) >= 4
    assert scraper.latest(b, now[0]) is None and scraper.failures[b] == 2
    assert scraper.latest(a, now[0] + 3.5) is None  # stale is unknown, never zero
    assert len(seen) == 2
    rate = horizon.allocation_rate(a)
    assert rate is not None and rate > 0
    h = horizon.horizon_s(a, now[0])
    assert h is not None and h == pytest.approx(512 / rate)


async def test_the_interval_is_in_the_clock_s_time() -> None:
    """With ``time_scale`` wall seconds per second of its clock (``RouterSettings
    .time_scale`` in front of replicas simulated 100x faster), a 1 s interval is 10 ms of
    wall time: the replicas are scraped once per second of their own time."""
    import asyncio
    import time

    rounds = {0.01: 0, 1.0: 0}

    async def run(scale: float) -> None:
        def targets() -> list[tuple[ReplicaId, str]]:
            rounds[scale] += 1
            return []

        async with aiohttp.ClientSession() as http:
            scraper = MetricsScraper(http, targets, clock=lambda: time.monotonic() / scale,
                                     interval_s=1.0, time_scale=scale)
            task = asyncio.create_task(scraper.run())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    await asyncio.gather(run(0.01), run(1.0))
    assert rounds[1.0] == 1
    assert 10 <= rounds[0.01] <= 31, rounds
