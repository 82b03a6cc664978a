"""Helpers shared by the router tests (settings, metrics scraping, request bodies)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvkeys.types import ReplicaId
from router.config import RouterSettings
from router.scoring import ReplicaScore
from tests.router.fake_replica import FakeReplica

FAST_HEALTH = {"interval_s": 0.05, "fails_to_down": 2, "successes_to_up": 2}


def router_settings(replicas: Sequence[FakeReplica | str], **overrides: Any) -> RouterSettings:
    urls = [r if isinstance(r, str) else r.url for r in replicas]
    # These tests exercise the proxy; the default ``kv`` policy is tested on its own.
    # A generous probe timeout: a loaded machine must not mark an in-process fake down
    # (tests about hung replicas set their own).
    data: dict[str, Any] = {"replicas": [{"url": u} for u in urls], "health": dict(FAST_HEALTH),
                            "policy": "round_robin", "timeouts": {"health_probe_s": 5.0}}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RouterSettings(**data)


Samples = dict[tuple[str, tuple[Any, ...]], float]


async def scrape(client: aiohttp.ClientSession, url: str) -> Samples:
    """``/metrics`` as ``{(sample name, sorted label items): value}``."""
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def inflight(client: aiohttp.ClientSession, url: str) -> float:
    """Sum of ``router_inflight_requests`` over replicas."""
    metrics = await scrape(client, url)
    return sum(v for (name, _), v in metrics.items() if name == "router_inflight_requests")


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "stream": stream}
    body.update(extra)
    return body


async def measure_ttfb(client: aiohttp.ClientSession, direct_url: str, router_url: str,
                       body: bytes, tries: int = 20, *, gap_s: float = 0.02,
                       added_s: float = 0.03) -> tuple[float, float, float]:
    """Best time to first body byte, direct and routed, and the best routed gap between
    the response headers and the first body byte, over rounds of one direct and one
    routed request: at least 3 rounds, at most ``tries``, stopping once the best gap is
    under ``gap_s`` and the best routed time within ``added_s`` of the best direct one (a
    stall that happens every time survives every round; load noise does not)."""

    async def once(base: str) -> tuple[float, float]:
        t0 = time.monotonic()
        async with client.post(base + "/v1/chat/completions", data=body) as resp:
            t_headers = time.monotonic()
            await resp.content.readany()
            t_first = time.monotonic()
            await resp.read()
        return t_first - t0, t_first - t_headers

    direct = routed = gap = float("inf")
    for i in range(tries):
        direct = min(direct, (await once(direct_url))[0])
        routed_t, routed_gap = await once(router_url)
        routed, gap = min(routed, routed_t), min(gap, routed_gap)
        if i >= 2 and gap < gap_s and routed < direct + added_s:
            break
    return direct, routed, gap


def replica_score(
    replica: ReplicaId, expected: float, total: float, queued: float = 0.0
) -> ReplicaScore:
    """A ranked replica for the pure pricing and choice steps: ``expected`` cached tokens,
    score ``total``, ``queued`` prefill tokens; everything else neutral."""
    return ReplicaScore(
        replica=replica, matched_blocks=0, gpu_blocks=0, cpu_blocks=0, storage_blocks=0,
        usable_blocks=0, predicted_cached_tokens=int(expected), expected_cached_tokens=expected,
        p_index=1.0, p_resident_hot=1.0, p_resident_tail=1.0, wait_s=0.0, new_tokens=0.0,
        queued_prefill_tokens=queued, decode_load=0.0, placements=0.0, load_known=True,
        score=total,
    )
