"""``/metrics`` of the simulated replica, with vLLM 0.32's metric names and labels.

``SimMetrics(engine, model_name, registry)`` registers one collector on a per-instance
``CollectorRegistry`` (no global state).  Values are read from the engine at scrape
time, so the hot path only bumps plain integers (``SchedulerStats``) and appends TTFT
samples, which the collector folds into a histogram when scraped.

Series (labels ``model_name``, ``engine``="0" as in vLLM's ``PrometheusStatLogger``):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (evictable cached blocks count as free),
``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:num_preemptions_total``, ``vllm:request_success_total{finished_reason}``,
``vllm:time_to_first_token_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:e2e_request_latency_seconds`` (vLLM's buckets; *simulated* seconds), and
``vllm:cache_config_info`` (labels: the cache config fields and ``engine``, no model).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from replica.sim.engine import SimEngine

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
"""vLLM 0.32's ``TIME_TO_FIRST_TOKEN_BUCKETS`` (``vllm/v1/metrics/buckets.py``)."""
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
"""vLLM 0.32's ``REQUEST_LATENCY_BUCKETS`` (e2e and queue-time histograms)."""


class _Histogram:
    """Cumulative bucket counts folded from drained samples."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def fold(self, samples: list[float]) -> None:
        counts = self.counts
        for x in samples:
            counts[bisect.bisect_left(self.bounds, x)] += 1
            self.total += x

    def family(self, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        h = HistogramMetricFamily(self.name, self.doc, labels=labels)
        h.add_metric(values, buckets, self.total)
        return h

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, "0"]
        self._ttft = _Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._queue = _Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self._e2e = _Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.",
                               REQUEST_LATENCY_BUCKETS)

    def fold(self) -> None:
        """Move the engine's pending latency samples into the histograms."""
        st = self._engine.scheduler.stats
        for hist, attr in ((self._ttft, "ttfts"), (self._queue, "queue_times"),
                           (self._e2e, "e2e_latencies")):
            samples = getattr(st, attr)
            if samples:
                setattr(st, attr, [])
                hist.fold(samples)

    def collect(self) -> Iterator[Metric]:
        eng = self._engine
        st = eng.scheduler.stats
        names = ["model_name", "engine"]
        lv = self._labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", eng.num_running)
        yield gauge("vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.", eng.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.", eng.pool.usage())
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      st.prefix_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", st.prefix_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      st.generation_tokens)
        yield counter("vllm:num_preemptions",
                      "Cumulative number of preemption from the engine.", st.preemptions)
        ok = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        ok.add_metric([*lv, "length"], st.finished)
        yield ok

        self.fold()
        for hist in (self._ttft, self._queue, self._e2e):
            yield hist.family(names, lv)

        cfg = eng.config
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "hash_block_size": str(cfg.block_size),
            "num_cpu_blocks": str(cfg.cpu_offload_blocks or None),
            "num_gpu_blocks": str(eng.pool.num_blocks),
            "prefix_caching_hash_algo": "sha256",
            "engine": "0",
        }
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        g.add_metric(list(info.values()), 1.0)
        yield g


class SimMetrics:
    """The replica's Prometheus registry (one per server instance)."""

    def __init__(
        self, engine: SimEngine, model_name: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        collector = _EngineCollector(engine, model_name)
        self.registry.register(collector)
        # Fold samples as they pile up, so an unscraped replica does not grow.
        engine.scheduler.stats.fold_hook = collector.fold

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)
