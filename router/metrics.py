"""Every Prometheus series of the router, created against an injected ``CollectorRegistry``.

Naming: ``router_<subsystem>_<name>_<unit>`` with ``_total`` / ``_seconds`` suffixes.
Labels are bounded: replica ids (from the configuration), HTTP status codes, endpoint
kinds, policy names and reasons (small per-policy enums), outcomes (an enum below).
Never session ids, client-supplied model names or prompts.

State gauges (in-flight, queued prefill tokens, health) are read from the load tracker and
the replica registry at scrape time by ``_StateCollector``: the hot path pays nothing.

Other components add their series here (one module for all metrics), as attributes of
``RouterMetrics``; ``close()`` unregisters everything so an app can be built twice on
one registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from router.load import LoadTracker
    from router.replicas import ReplicaRegistry

__all__ = ["Outcome", "RouterMetrics"]

Outcome = Literal[
    "ok", "http_4xx", "http_5xx", "connect_error", "timeout", "midstream_error", "cancelled"
]
"""``router_upstream_requests_total{outcome}`` values."""

# Latency buckets: the router adds well under a millisecond, while a first token under
# load can take tens of seconds; 1 ms .. 60 s covers both ends.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


class RouterMetrics:
    """The router's series.  Build once per app, in the lifespan."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "router_requests_total", "Requests answered by the router, by endpoint and status.",
            ["endpoint", "status"], registry=registry,
        )
        self.upstream_requests = Counter(
            "router_upstream_requests_total", "Upstream attempts, by replica and outcome.",
            ["replica", "outcome"], registry=registry,
        )
        self.decisions = Counter(
            "router_decisions_total", "Routing decisions, by policy and reason.",
            ["policy", "reason"], registry=registry,
        )
        self.ttfb = Histogram(
            "router_ttfb_seconds", "Time from the upstream request to its first body byte.",
            ["replica"], buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.request_duration = Histogram(
            "router_request_duration_seconds", "Whole request time as seen by the router.",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.failovers = Counter(
            "router_failovers_total", "Retries on another replica after this one failed.",
            ["replica"], registry=registry,
        )
        self.client_disconnects = Counter(
            "router_client_disconnects_total", "Clients that left before the response ended.",
            registry=registry,
        )
        self.health_probes = Counter(
            "router_health_probes_total", "Health probes, by replica and result.",
            ["replica", "result"], registry=registry,
        )
        self.health_transitions = Counter(
            "router_health_transitions_total", "Health state changes, by replica and new state.",
            ["replica", "state"], registry=registry,
        )
        self._state: _StateCollector | None = None

    def bind_state(self, replicas: ReplicaRegistry, load: LoadTracker) -> None:
        """Expose the registry's health and the tracker's load as scrape-time gauges."""
        self._state = _StateCollector(replicas, load)
        self.registry.register(self._state)

    def close(self) -> None:
        """Unregister every series from the registry."""
        for collector in (
            self.requests, self.upstream_requests, self.decisions, self.ttfb,
            self.request_duration, self.failovers, self.client_disconnects,
            self.health_probes, self.health_transitions, self._state,
        ):
            if collector is not None:
                self.registry.unregister(collector)
        self._state = None


class _StateCollector:
    """Gauges computed at scrape time from live router state."""

    def __init__(self, replicas: ReplicaRegistry, load: LoadTracker) -> None:
        self._replicas = replicas
        self._load = load

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "router_inflight_requests", "Requests in flight, by replica.", labels=["replica"]
        )
        queued = GaugeMetricFamily(
            "router_queued_prefill_tokens",
            "Prompt tokens of in-flight requests before their first byte, by replica.",
            labels=["replica"],
        )
        decoding = GaugeMetricFamily(
            "router_decoding_requests", "In-flight requests past their first byte, by replica.",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily(
            "router_replica_healthy", "1 when the replica gets traffic, else 0.",
            labels=["replica"],
        )
        for state in self._replicas.all():
            load = self._load.get(state.id)
            inflight.add_metric([state.id], load.in_flight)
            queued.add_metric([state.id], load.queued_prefill_tokens)
            decoding.add_metric([state.id], load.decoding)
            healthy.add_metric([state.id], 1.0 if state.healthy else 0.0)
        yield inflight
        yield queued
        yield decoding
        yield healthy
