"""Periodic scrape of each replica's Prometheus ``/metrics``: the load other routers add.

The router's own accounting only sees its own traffic; a replica behind several routers
(or with direct clients) is busier than that.  Every ``interval_s`` the scraper reads,
per replica, these vLLM series (summed over ``engine`` labels, i.e. DP ranks):

* ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (queue and batch);
* ``vllm:kv_cache_usage_perc`` (falling back to the pre-0.13 ``gpu_cache_usage_perc``;
  averaged over engines): the share of blocks pinned by running requests;
* ``vllm:cache_config_info`` labels ``block_size`` and ``num_gpu_blocks``;
* counters for the eviction horizon and calibration: ``vllm:prompt_tokens_total``,
  ``vllm:prompt_tokens_by_source_total{source="local_compute"}``,
  ``vllm:prefix_cache_queries_total`` / ``_hits_total`` (and the older ``gpu_`` names),
  ``vllm:external_prefix_cache_hits_total``, ``vllm:generation_tokens_total``.

Contract: a scrape older than ``stale_after_s`` (or a failed one) is **unknown**:
``latest()`` returns ``None`` and the scoring uses the router's own accounting alone,
never zeros.  Each scrape has its own timeout; the loop is one task owned by the app's
``TaskOwner`` and scrapes replicas concurrently.  ``parse_vllm_metrics`` is a pure,
line-based parser that looks only at the names above (the full exposition parser would
cost milliseconds per replica per second on a busy box).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from kvkeys.types import ReplicaId

__all__ = [
    "LatestSamples",
    "MetricsScraper",
    "SampleListener",
    "ScrapeSample",
    "Scrapes",
    "parse_vllm_metrics",
]

_log = logging.getLogger(__name__)

_SUMMED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total": "external_hits_total",
}
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class ScrapeSample:
    """One replica's vLLM gauges and counters at time ``t`` (``None`` = not exported)."""

    t: float
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prompt_tokens_total: float | None = None
    computed_prompt_tokens_total: float | None = None
    """Prompt tokens computed (not served from any cache)."""
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    generation_tokens_total: float | None = None


def _labels(line: str) -> dict[str, str]:
    start, end = line.find("{"), line.rfind("}")
    out: dict[str, str] = {}
    if start < 0 or end < start:
        return out
    for part in line[start + 1 : end].split('",'):
        name, _, value = part.partition("=")
        out[name.strip()] = value.strip().strip('"')
    return out


def _value(line: str) -> float | None:
    end = line.rfind("}")
    rest = line[end + 1 :] if end >= 0 else line.split(None, 1)[1] if " " in line else ""
    parts = rest.split()
    if not parts:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


def parse_vllm_metrics(text: str, t: float) -> ScrapeSample:
    """Extract the series the router uses from a Prometheus text exposition."""
    sums: dict[str, float] = {}
    usage: list[float] = []
    local_compute: float | None = None
    block_size: int | None = None
    gpu_blocks: int | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        cut = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < cut:
                cut = i
        name = line[:cut]
        field = _SUMMED.get(name)
        if field is not None:
            v = _value(line)
            if v is not None:
                sums[field] = sums.get(field, 0.0) + v
        elif name in _USAGE:
            v = _value(line)
            if v is not None and (name == _USAGE[0] or not usage):
                usage.append(v)
        elif name == _BY_SOURCE:
            if _labels(line).get("source") == "local_compute":
                v = _value(line)
                if v is not None:
                    local_compute = (local_compute or 0.0) + v
        elif name == _CACHE_INFO:
            labels = _labels(line)
            try:
                if "block_size" in labels:
                    block_size = int(labels["block_size"])
                if labels.get("num_gpu_blocks") not in (None, "", "None"):
                    gpu_blocks = (gpu_blocks or 0) + int(labels["num_gpu_blocks"])
            except ValueError:
                pass
    computed = local_compute
    prompt = sums.get("prompt_tokens_total")
    if computed is None and prompt is not None:
        computed = prompt - sums.get("prefix_cache_hits_total", 0.0) - sums.get(
            "external_hits_total", 0.0
        )
        computed = max(0.0, computed)
    return ScrapeSample(
        t=t,
        waiting=sums.get("waiting"),
        running=sums.get("running"),
        kv_usage=sum(usage) / len(usage) if usage else None,
        block_size=block_size,
        num_gpu_blocks=gpu_blocks,
        prompt_tokens_total=prompt,
        computed_prompt_tokens_total=computed,
        prefix_cache_queries_total=sums.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=sums.get("prefix_cache_hits_total"),
        generation_tokens_total=sums.get("generation_tokens_total"),
    )


SampleListener = Callable[[ReplicaId, ScrapeSample], None]


class LatestSamples:
    """Each replica's latest sample, fresh for ``stale_after_s``, and the listeners told
    of every new one (``Scrapes``): what ``MetricsScraper`` keeps of its scrapes, and
    what the replay's model of them keeps (``kvroute.replay.loop``)."""

    def __init__(self, stale_after_s: float, listeners: Iterable[SampleListener] = ()) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[ReplicaId, ScrapeSample] = {}
        self._listeners = list(listeners)

    def add_listener(self, listener: SampleListener) -> None:
        """Call ``listener(replica, sample)`` after each new sample."""
        self._listeners.append(listener)

    def latest(self, replica: ReplicaId, now: float) -> ScrapeSample | None:
        """The last sample of ``replica`` if fresher than ``stale_after_s``, else ``None``."""
        sample = self._latest.get(replica)
        if sample is None or now - sample.t > self.stale_after_s:
            return None
        return sample

    def observe(self, replica: ReplicaId, sample: ScrapeSample) -> None:
        """Keep ``sample`` as ``replica``'s latest and tell the listeners."""
        self._latest[replica] = sample
        for listener in self._listeners:
            listener(replica, sample)


class Scrapes(Protocol):
    """What the ``kv`` policy reads of the scrapes: ``MetricsScraper``, or the replay's
    model of them (``kvroute.replay.loop``)."""

    def add_listener(self, listener: SampleListener) -> None:
        """Call ``listener(replica, sample)`` after each scrape."""

    def latest(self, replica: ReplicaId, now: float) -> ScrapeSample | None:
        """The last sample of ``replica`` if still fresh, else ``None``."""


class MetricsScraper:
    """Scrapes every replica's ``/metrics`` on an interval; keeps the latest sample."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        targets: Callable[[], Iterable[tuple[ReplicaId, str]]],
        *,
        clock: Callable[[], float],
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        stale_after_s: float = 3.0,
        listeners: Iterable[SampleListener] = (),
        time_scale: float = 1.0,
    ) -> None:
        self._http = http
        self._targets = targets
        self._clock = clock
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._samples = LatestSamples(stale_after_s, listeners)
        self.failures: dict[ReplicaId, int] = {}
        self._time_scale = time_scale
        """Wall seconds per second of ``clock`` (the interval is in ``clock``'s time)."""

    def add_listener(self, listener: SampleListener) -> None:
        """Call ``listener(replica, sample)`` after each successful scrape."""
        self._samples.add_listener(listener)

    def latest(self, replica: ReplicaId, now: float) -> ScrapeSample | None:
        """The last sample of ``replica`` if fresher than ``stale_after_s``, else ``None``."""
        return self._samples.latest(replica, now)

    async def run(self) -> None:
        """Scrape forever (cancel to stop)."""
        while True:
            started = self._clock()
            await self.scrape_once()
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self.interval_s - elapsed) * self._time_scale)

    async def scrape_once(self) -> None:
        """One concurrent round over every target."""
        targets = list(self._targets())
        if targets:
            await asyncio.gather(*(self._scrape(r, url) for r, url in targets))

    async def _scrape(self, replica: ReplicaId, url: str) -> None:
        try:
            async with self._http.get(f"{url}/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message="bad status"
                    )
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError) as exc:
            self.failures[replica] = self.failures.get(replica, 0) + 1
            _log.debug("scrape of %s failed: %r", replica, exc)
            return
        self._samples.observe(replica, parse_vllm_metrics(text, self._clock()))
