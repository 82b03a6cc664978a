"""The sim's Prometheus exposition, straight from an engine (no HTTP)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.metrics import SimMetrics
from replica.sim.scheduler import SimRequest


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name == "vllm:cache_config_info":
                continue
            out[s.name] = s.value
    return out


def test_counts_survive_sample_folding_and_registries_are_per_instance() -> None:
    eng = SimEngine(EngineConfig(model="m", num_blocks=64, time_scale=0), list(range(10, 500)))
    metrics = SimMetrics(eng, "m")
    other = SimMetrics(SimEngine(EngineConfig(model="m", time_scale=0), [1, 2]), "m")
    eng.scheduler.stats.max_pending = 5  # forces the fold hook many times
    for i in range(23):
        prompt = [7] * 40 + [i]
        keys = eng.scheduler.make_keys(prompt, cache_salt=None, lora_name=None)
        eng.scheduler.add(SimRequest(str(i), prompt, 3, keys=keys), eng.now())
        while eng.scheduler.has_work:
            eng.step_virtual()
    got = _samples(metrics.render().decode())
    assert got["vllm:time_to_first_token_seconds_count"] == 23
    assert got["vllm:e2e_request_latency_seconds_count"] == 23
    assert got["vllm:request_queue_time_seconds_count"] == 23
    assert got["vllm:generation_tokens_total"] == 69
    assert got["vllm:prefix_cache_queries_total"] == 23 * 41
    assert got["vllm:prefix_cache_hits_total"] == 22 * 32  # 2 blocks of 16, after the first
    assert got["vllm:kv_cache_usage_perc"] == 0.0
    assert _samples(other.render().decode())["vllm:generation_tokens_total"] == 0
