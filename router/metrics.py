"""Every Prometheus series of the router, created against an injected ``CollectorRegistry``.

Naming: ``router_<subsystem>_<name>_<unit>`` with ``_total`` / ``_seconds`` suffixes.
Labels are bounded: replica ids (from the configuration), HTTP status codes, endpoint
kinds, policy names and reasons (small per-policy enums), outcomes (an enum below).
Never session ids, client-supplied model names or prompts.

State gauges (in-flight, queued prefill tokens, health) are read from the load tracker and
the replica registry at scrape time by ``_StateCollector``: the hot path pays nothing.

The five series every proxied request updates (requests, request duration, decisions,
upstream attempts, TTFB) are ``FastCounter`` / ``FastHistogram`` (``router.fast_metrics``).

Other components add their series here (one module for all metrics), as attributes of
``RouterMetrics``; ``close()`` unregisters everything so an app can be built twice on
one registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from router.fast_metrics import FastCounter, FastHistogram

if TYPE_CHECKING:
    from router.load import LoadTracker
    from router.replica_registry import ReplicaRegistry

__all__ = [
    "REMOTE_RENDER_COUNTERS",
    "TENANT_OUTCOMES",
    "FastCounter",
    "FastHistogram",
    "KvMetrics",
    "Outcome",
    "RemoteRenderCollector",
    "RouterMetrics",
    "TenantMetrics",
]

Outcome = Literal[
    "ok", "http_4xx", "http_5xx", "connect_error", "bad_response", "timeout", "midstream_error",
    "cancelled",
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
        self.requests = FastCounter(
            "router_requests_total", "Requests answered by the router, by endpoint and status.",
            ["endpoint", "status"], registry,
        )
        self.upstream_requests = FastCounter(
            "router_upstream_requests_total", "Upstream attempts, by replica and outcome.",
            ["replica", "outcome"], registry,
        )
        self.decisions = FastCounter(
            "router_decisions_total", "Routing decisions, by policy and reason.",
            ["policy", "reason"], registry,
        )
        self.ttfb = FastHistogram(
            "router_ttfb_seconds", "Time from the upstream request to its first body byte.",
            ["replica"], registry, buckets=_LATENCY_BUCKETS,
        )
        self.request_duration = FastHistogram(
            "router_request_duration_seconds", "Whole request time as seen by the router.",
            ["endpoint"], registry, buckets=_LATENCY_BUCKETS,
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
        self.connections_refused = Counter(
            "router_connections_refused_total",
            "Client connections closed by the router's guards, by reason (max_connections, "
            "header_timeout, body_timeout, headers_too_large).",
            ["reason"], registry=registry,
        )
        self._state: _StateCollector | None = None
        self.kv = KvMetrics(registry)
        """The KV-aware routing series (``router.kv_policy`` and its helpers)."""
        self.tenants = TenantMetrics(registry)
        """API keys and per-tenant limits (``router.tenancy``)."""

    def bind_state(self, replicas: ReplicaRegistry, load: LoadTracker) -> None:
        """Expose the registry's health and the tracker's load as scrape-time gauges."""
        self._state = _StateCollector(replicas, load)
        self.registry.register(self._state)

    def close(self) -> None:
        """Unregister every series from the registry."""
        for collector in (
            self.requests, self.upstream_requests, self.decisions, self.ttfb,
            self.request_duration, self.failovers, self.client_disconnects,
            self.health_probes, self.health_transitions, self.connections_refused,
            self._state,
        ):
            if collector is not None:
                self.registry.unregister(collector)
        self._state = None
        self.kv.close()
        self.tenants.close()


TENANT_OUTCOMES = ("admitted", "rate_limited", "concurrency_limited")
"""``router_tenant_requests_total{outcome}`` values."""


class TenantMetrics:
    """Series of API keys and tenants.  The ``tenant`` label takes configured tenant
    names only (never a key or anything the client sent); ``reason`` a small enum."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "router_tenant_requests_total",
            "Authenticated requests by tenant and admission outcome (admitted, "
            "rate_limited, concurrency_limited).",
            ["tenant", "outcome"], registry=registry,
        )
        self.inflight = Gauge(
            "router_tenant_inflight_requests", "Admitted requests in flight, by tenant.",
            ["tenant"], registry=registry,
        )
        self.auth_failures = Counter(
            "router_auth_failures_total",
            "Requests refused by authentication, by reason (missing_key, invalid_key, "
            "forbidden).",
            ["reason"], registry=registry,
        )

    def close(self) -> None:
        """Unregister every series."""
        for collector in (self.requests, self.inflight, self.auth_failures):
            self.registry.unregister(collector)


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


# Routing cost: the KV path (render + hash + lookup + score) should stay well under a
# millisecond; 10 us .. 100 ms shows both the warm path and a remote render.
_ROUTE_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 1e-1,
)
# Prediction error in tokens (actual - predicted cached tokens).  Errors are whole
# tokens, so the -1 and 0 bounds isolate exact matches: count(le=0) - count(le=-1).
_ERROR_BUCKETS = (
    -16384, -4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096, 16384,
)
# Think time between a session's turns: tool calls (sub-second) to humans (minutes).
_THINK_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class KvMetrics:
    """Series of the KV-aware policies: decisions' predictions, receipts, sessions,
    eviction horizon, and the routing cost.  Labels: replica ids, policy names and small
    enums only.  The series every routed request updates (about ten updates per ``kv``
    request) are ``FastCounter`` / ``FastHistogram``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.route_seconds = FastHistogram(
            "router_route_seconds",
            "Time a policy takes to decide (render, hash, index lookup, scoring), by policy.",
            ["policy"], registry, buckets=_ROUTE_BUCKETS,
        )
        self.stage_seconds = FastHistogram(
            "router_kv_stage_seconds",
            "Time of each stage of the kv policy: render, lookup, score.",
            ["stage"], registry, buckets=_ROUTE_BUCKETS,
        )
        self.predicted_cached_tokens = FastCounter(
            "router_kv_predicted_cached_tokens_total",
            "Cached tokens the index predicts on the chosen replica (point prediction).",
            ["replica"], registry,
        )
        self.expected_cached_tokens = FastCounter(
            "router_kv_expected_cached_tokens_total",
            "Cached tokens the scoring credited on the chosen replica (probability-weighted).",
            ["replica"], registry,
        )
        self.prompt_tokens = FastCounter(
            "router_receipt_prompt_tokens_total",
            "Prompt tokens the replicas reported, by replica and kind: cached (prefill "
            "saved) or computed.",
            ["replica", "kind"], registry,
        )
        self.receipts = FastCounter(
            "router_receipts_total",
            "Receipts checked against their prediction, by replica and outcome "
            "(match, over, under, missing).",
            ["replica", "outcome"], registry,
        )
        # prometheus_client's own: with negative buckets it writes ``_count`` but no
        # ``_sum``, which ``FastHistogram`` does not mimic.
        self.prediction_error = Histogram(
            "router_kv_prediction_error_tokens",
            "Reported minus predicted cached tokens, per request, by replica.",
            ["replica"], buckets=_ERROR_BUCKETS, registry=registry,
        )
        self.disagreements = Counter(
            "router_kv_prediction_disagreements_total",
            "Receipts far from their prediction (rendering or index wrong), by replica and "
            "direction (over: predicted more than served).",
            ["replica", "direction"], registry=registry,
        )
        self.session_turns = FastCounter(
            "router_session_turns_total",
            "Later turns of a session, by policy and placement (same_replica or moved).",
            ["policy", "placement"], registry,
        )
        self.think_time = FastHistogram(
            "router_session_think_time_seconds",
            "Time between a turn finishing and the session's next request.",
            [], registry, buckets=_THINK_BUCKETS,
        )
        self.think_time.labels()  # unlabelled: exported (empty) from the start
        self.session_returns = FastCounter(
            "router_session_returns_total",
            "Later turns by whether they came back within their replica's eviction horizon.",
            ["replica", "outcome"], registry,
        )
        self.prefix_breaks = FastCounter(
            "router_prefix_breaks_total",
            "Later turns whose prompt does not extend the previous one, by likely cause.",
            ["cause"], registry,
        )
        self.prefix_break_lost_tokens = FastCounter(
            "router_prefix_break_lost_tokens_total",
            "Tokens of previous prompts invalidated by prefix breaks.",
            [], registry,
        )
        self.prefix_break_lost_tokens.labels()  # unlabelled: exported (0) from the start
        self.moved_given_up_tokens = Counter(
            "router_kv_moved_given_up_tokens_total",
            "Expected cached tokens a later turn gave up by leaving the replica of its "
            "previous turn (that replica's expected hit minus the chosen one's), by the "
            "replica left.",
            ["replica"], registry=registry,
        )
        self.came_back_turns = Counter(
            "router_kv_came_back_turns_total",
            "Later turns routed back to the replica their session had moved away from, by "
            "that replica.",
            ["replica"], registry=registry,
        )
        self.came_back_held_tokens = Counter(
            "router_kv_came_back_held_tokens_total",
            "Cached tokens predicted on the replica a session came back to (what it still "
            "held of the conversation), by that replica.",
            ["replica"], registry=registry,
        )
        self.outlook_displaced_tokens = FastCounter(
            "router_kv_outlook_displaced_tokens_total",
            "The look ahead's forecast, per decision, of returning conversations' tokens "
            "the placement evicts on the chosen replica (before they come back), by "
            "replica.",
            ["replica"], registry,
        )
        self.outlook_retained_tokens = FastCounter(
            "router_kv_outlook_retained_tokens_total",
            "The look ahead's forecast, per decision, of the conversation's tokens still "
            "cached on the chosen replica when its next turn comes (compare with "
            "router_kv_predicted_cached_tokens_total of the later turns that stay), by "
            "replica.",
            ["replica"], registry,
        )
        self.outlook_pool_wait = FastCounter(
            "router_kv_outlook_pool_wait_seconds_total",
            "The look ahead's forecast, per decision, of the wait for pool space on the "
            "chosen replica (requests in flight must finish first), by replica.",
            ["replica"], registry,
        )
        self.fallbacks = Counter(
            "router_kv_fallbacks_total",
            "Times the kv policy could not use the index, by cause (index_down, "
            "render_failed, no_prompt).",
            ["cause"], registry=registry,
        )
        self.scrape_failures = Counter(
            "router_scrape_failures_total", "Failed /metrics scrapes, by replica.",
            ["replica"], registry=registry,
        )
        self._state: _KvStateCollector | None = None

    def bind_state(self, source: KvStateSource) -> None:
        """Expose horizon and load terms as scrape-time gauges read from ``source``."""
        if self._state is not None:
            self.registry.unregister(self._state)
        self._state = _KvStateCollector(source)
        self.registry.register(self._state)

    def close(self) -> None:
        """Unregister every series."""
        for collector in (
            self.route_seconds, self.stage_seconds, self.predicted_cached_tokens,
            self.expected_cached_tokens, self.prompt_tokens, self.receipts,
            self.prediction_error, self.disagreements, self.session_turns, self.think_time,
            self.session_returns, self.prefix_breaks, self.prefix_break_lost_tokens,
            self.moved_given_up_tokens, self.came_back_turns, self.came_back_held_tokens,
            self.outlook_displaced_tokens, self.outlook_retained_tokens, self.outlook_pool_wait,
            self.fallbacks, self.scrape_failures, self._state,
        ):
            if collector is not None:
                self.registry.unregister(collector)
        self._state = None


class KvStateSource(Protocol):
    """What ``KvMetrics`` reads at scrape time (implemented by the kv policy)."""

    def gauge_rows(self) -> Iterator[tuple[str, str, float]]:
        """``(gauge name, replica, value)`` rows; names from ``KV_GAUGES``."""
        ...


KV_GAUGES = {
    "router_eviction_horizon_seconds":
        "Estimated seconds an idle cached block survives on the replica (free blocks over "
        "block allocation rate); compare with router_session_think_time_seconds.",
    "router_kv_allocation_blocks_per_second":
        "Estimated KV blocks the replica allocates per second.",
    "router_kv_load_queued_prefill_tokens":
        "Queued prefill tokens the kv scoring used last (own accounting plus scraped "
        "foreign queue).",
    "router_kv_load_decode":
        "Decode load the kv scoring used last (own decoding or scraped running).",
    "router_kv_index_trust":
        "The index trust factor (staleness, gaps, receipts) the kv scoring used last.",
}


class _KvStateCollector:
    def __init__(self, source: KvStateSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, doc, labels=["replica"])
            for name, doc in KV_GAUGES.items()
        }
        for name, replica, value in self._source.gauge_rows():
            family = families.get(name)
            if family is not None:
                family.add_metric([replica], value)
        yield from families.values()


class RemoteRenderCounters(Protocol):
    """The remote-rendering counters (``prompt.remote_render.RemoteRenderStats``)."""

    fallbacks: int
    cache_hits: int
    requests: int
    errors: int
    timeouts: int


REMOTE_RENDER_COUNTERS = {
    "fallbacks": ("router_tokenize_fallbacks_total",
                  "Prompts rendered by a replica's /tokenize because no local tokenizer "
                  "was configured for the model (cache hits included)."),
    "cache_hits": ("router_tokenize_cache_hits_total",
                   "Remote renders answered from the router's cache of /tokenize answers."),
    "requests": ("router_tokenize_requests_total", "/tokenize requests sent to replicas."),
    "errors": ("router_tokenize_errors_total",
               "/tokenize requests that failed (error status or unreadable answer)."),
    "timeouts": ("router_tokenize_timeouts_total", "/tokenize requests that timed out."),
}


class RemoteRenderCollector:
    """The ``/tokenize`` fallback counters, read at scrape time from ``stats``."""

    def __init__(self, stats: RemoteRenderCounters) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for field, (name, doc) in REMOTE_RENDER_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(self._stats, field))
