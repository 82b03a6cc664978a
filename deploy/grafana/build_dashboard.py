"""Builds deploy/grafana/dashboards/kvroute.json, the provisioned kvroute dashboard.

The JSON file is what Grafana loads; this script is how it is written, so a panel is
edited here and the file regenerated (``python deploy/grafana/build_dashboard.py``).
``tests/deploy/test_dashboard.py`` checks that the file equals this script's output,
that every query parses, and that every series it names is exported by a running router
and simulated replica (or, for real-vLLM-only series, by vLLM 0.32).

Series: ``router_*`` from the kvroute routers (``router/metrics.py``,
``router/index_metrics.py``), ``vllm:*`` from the replicas; Prometheus adds the
``replica`` label to the replicas' series (``deploy/prometheus/prometheus.yml``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
"""The provisioned datasource (deploy/grafana/provisioning/datasources/prometheus.yml)."""
OUT = Path(__file__).resolve().parent / "dashboards" / "kvroute.json"
RI = "$__rate_interval"

Target = tuple[str, str]
"""(PromQL expression, legend)."""


def rate(series: str, fn: str = "rate") -> str:
    """``rate(series[$__rate_interval])`` (or another range function)."""
    return f"{fn}({series}[{RI}])"


def ratio(num: str, den: str, by: str = "") -> str:
    """``sum(num) / sum(den)`` of rates, optionally ``by`` labels."""
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}({rate(num)}) / {agg}({rate(den)})"


def quantile(q: float, bucket: str, by: str = "") -> str:
    """``histogram_quantile(q, sum by (le[, by]) (rate(bucket)))``."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(bucket)}))"


CACHED = 'router_receipt_prompt_tokens_total{kind="cached"}'
COMPUTED = 'router_receipt_prompt_tokens_total{kind="computed"}'
RECEIPT_TOKENS = "router_receipt_prompt_tokens_total"
UPSTREAM_FAILED = 'router_upstream_requests_total{outcome!="ok"}'
CLIENT_ERRORS = 'router_requests_total{status=~"4..|5.."}'


class Layout:
    """Panels on Grafana's 24-column grid: rows, then panels two per line."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._y = 0
        self._x = 0
        self._line_h = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        """A new row under everything so far."""
        self._y += self._line_h
        self._x, self._line_h = 0, 0
        self.panels.append({
            "type": "row", "title": title, "id": self._next_id(), "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": [],
        })  # fmt: skip
        self._y += 1

    def panel(
        self,
        title: str,
        targets: list[Target],
        *,
        unit: str = "short",
        desc: str = "",
        stack: bool = False,
        bounds: tuple[float, float] | None = None,
        w: int = 12,
        h: int = 8,
    ) -> None:
        """A time-series panel, placed after the previous one (wrapping at 24 columns)."""
        if self._x + w > 24:
            self._y += self._line_h
            self._x, self._line_h = 0, 0
        defaults: dict[str, Any] = {
            "unit": unit,
            "custom": {
                "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            },
        }  # fmt: skip
        if bounds is not None:
            defaults["min"], defaults["max"] = bounds
        self.panels.append({
            "type": "timeseries", "title": title, "id": self._next_id(),
            "datasource": DATASOURCE, "description": desc,
            "gridPos": {"h": h, "w": w, "x": self._x, "y": self._y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            },
            "targets": [
                {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                 "legendFormat": legend, "range": True, "instant": False}
                for i, (expr, legend) in enumerate(targets)
            ],
        })  # fmt: skip
        self._x += w
        self._line_h = max(self._line_h, h)


SHARE = (0.0, 1.0)


def _cache(d: Layout) -> None:
    d.row("Cache effectiveness")
    d.panel("Cached-token share", [
        (ratio(CACHED, RECEIPT_TOKENS), "routed requests (receipts)"),
        (ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
         "replicas' prefix cache"),
        (ratio(CACHED, RECEIPT_TOKENS, by="replica"), "{{replica}}"),
    ], unit="percentunit", bounds=SHARE, desc=(
        "Share of prompt tokens served from the prefix cache: from the usage the replicas "
        "reported on routed requests, and from the engines' own prefix-cache counters."
    ))  # fmt: skip
    d.panel("Prefill tokens saved and computed", [
        (f"sum by (replica) ({rate(CACHED)})", "{{replica}} saved (cached)"),
        (f"sum by (replica) ({rate(COMPUTED)})", "{{replica}} computed"),
    ], stack=True, desc=(
        "Prompt tokens per second the replicas did not have to prefill (cached) and did "
        "(computed), from the receipts of routed requests."
    ))  # fmt: skip
    d.panel("Predicted vs actual cached tokens", [
        (f"sum by (replica) ({rate('router_kv_predicted_cached_tokens_total')})",
         "{{replica}} predicted"),
        (f"sum by (replica) ({rate(CACHED)})", "{{replica}} reported"),
    ], desc=(
        "Cached tokens per second the index predicted on the chosen replica against what "
        "the replica reported (usage.prompt_tokens_details.cached_tokens)."
    ))  # fmt: skip
    d.panel("Prediction accuracy", [
        (ratio('router_receipts_total{outcome="match"}',
               'router_receipts_total{outcome!="missing"}'), "exact predictions"),
        (f"sum by (replica, direction) ({rate('router_kv_prediction_disagreements_total')})"
         f" / ignoring(direction) group_left sum by (replica) "
         f"({rate('router_receipts_total')})", "{{replica}} large error, {{direction}}"),
    ], unit="percentunit", bounds=SHARE, desc=(
        "Share of receipts whose reported cached tokens equal the prediction, and share "
        "far off (rendering or index wrong)."
    ))  # fmt: skip
    d.panel("Prediction error (reported - predicted)", [
        (quantile(q, "router_kv_prediction_error_tokens_bucket"), f"p{round(q * 100)}")
        for q in (0.01, 0.5, 0.99)
    ])  # fmt: skip
    d.panel("Receipts by outcome", [
        (f"sum by (outcome) ({rate('router_receipts_total')})", "{{outcome}}"),
    ], unit="reqps", stack=True)  # fmt: skip


def _routing(d: Layout) -> None:
    d.row("Routing decisions")
    d.panel("Decisions by policy and reason", [
        (f"sum by (policy, reason) ({rate('router_decisions_total')})",
         "{{policy}} / {{reason}}"),
    ], unit="reqps", stack=True)  # fmt: skip
    d.panel("Stickiness of later turns", [
        (ratio('router_session_turns_total{placement="same_replica"}',
               "router_session_turns_total", by="policy"), "{{policy}}"),
    ], unit="percentunit", bounds=SHARE, desc=(
        "Share of a session's later turns routed to the replica that served its previous "
        "turn."
    ))  # fmt: skip
    d.panel("Requests routed per replica", [
        (f"sum by (replica) ({rate('router_upstream_requests_total')})", "{{replica}}"),
    ], unit="reqps", stack=True)  # fmt: skip
    d.panel("KV fallbacks and prefix breaks", [
        (f"sum by (cause) ({rate('router_kv_fallbacks_total')})", "fallback: {{cause}}"),
        (f"sum by (cause) ({rate('router_prefix_breaks_total')})",
         "prefix break: {{cause}}"),
        (f"sum({rate('router_prefix_break_lost_tokens_total')})",
         "tokens lost to prefix breaks"),
    ])  # fmt: skip
    d.panel("Routing cost (p99)", [
        (quantile(0.99, "router_route_seconds_bucket", by="policy"), "{{policy}}"),
        (quantile(0.99, "router_kv_stage_seconds_bucket", by="stage"), "kv {{stage}}"),
    ], unit="s")  # fmt: skip


def _latency(d: Layout) -> None:
    d.row("Latency")
    for title, bucket in (
        ("Time to first token: router's view (router_ttfb_seconds)",
         "router_ttfb_seconds_bucket"),
        ("Time to first token: replicas' view (vllm:time_to_first_token_seconds)",
         "vllm:time_to_first_token_seconds_bucket"),
    ):  # fmt: skip
        d.panel(title, [
            (quantile(0.5, bucket), "p50"),
            (quantile(0.99, bucket), "p99"),
            (quantile(0.99, bucket, by="replica"), "p99 {{replica}}"),
        ], unit="s")  # fmt: skip


def _horizon(d: Layout) -> None:
    d.row("Eviction horizon")
    think = "router_session_think_time_seconds_bucket"
    d.panel("Eviction horizon vs think time", [
        ("max by (replica) (router_eviction_horizon_seconds)", "horizon {{replica}}"),
        (quantile(0.5, think), "think time p50"),
        (quantile(0.9, think), "think time p90"),
    ], unit="s", desc=(
        "How long an idle cached block survives on each replica (free blocks / allocation "
        "rate) against how long users take between turns: turns that come back after the "
        "horizon find their cache gone."
    ))  # fmt: skip
    d.panel("Later turns back within the horizon", [
        (f"sum by (replica, outcome) ({rate('router_session_returns_total')})",
         "{{replica}} {{outcome}}"),
        ("max by (replica) (router_kv_allocation_blocks_per_second)",
         "{{replica}} blocks allocated/s"),
    ])  # fmt: skip


def _load(d: Layout) -> None:
    d.row("Per-replica load")
    d.panel("Router-side load (summed over routers)", [
        ("sum by (replica) (router_queued_prefill_tokens)",
         "{{replica}} queued prefill tokens"),
        ("sum by (replica) (router_decoding_requests)", "{{replica}} decoding"),
        ("sum by (replica) (router_inflight_requests)", "{{replica}} in flight"),
    ], desc=(
        "Each router only sees its own traffic; the kv scoring adds the replicas' scraped "
        "queues (next panel)."
    ))  # fmt: skip
    d.panel("Load terms used by the kv scoring", [
        ("max by (replica) (router_kv_load_queued_prefill_tokens)",
         "{{replica}} queued prefill"),
        ("max by (replica) (router_kv_load_decode)", "{{replica}} decode"),
    ])  # fmt: skip
    d.panel("Replica queues (vLLM)", [
        ("sum by (replica) (vllm:num_requests_running)", "{{replica}} running"),
        ("sum by (replica) (vllm:num_requests_waiting)", "{{replica}} waiting"),
    ])  # fmt: skip
    d.panel("KV-cache usage (pinned by running requests)", [
        ("max by (replica) (vllm:kv_cache_usage_perc)", "{{replica}}"),
    ], unit="percentunit", bounds=SHARE)  # fmt: skip


def _index(d: Layout) -> None:
    d.row("Index and KV events")
    d.panel("Index size (blocks held per replica)", [
        ("max by (replica) (router_index_blocks)", "{{replica}}"),
    ], desc="Request keys the KV index attributes to each replica, any tier.")  # fmt: skip
    d.panel("KV event lag", [
        ("max by (replica) (router_kv_events_receive_lag_seconds)",
         "{{replica}} receive lag"),
        ("min by (replica) (router_kv_events_connected)", "{{replica}} connected"),
    ], unit="s", desc=(
        "Delay from the engine stamping a KV event batch to the ingesting router receiving "
        "it; and whether each replica's event stream is connected (1)."
    ))  # fmt: skip
    d.panel("KV events applied", [
        (f"sum by (replica, type) ({rate('router_kv_events_applied_total')})",
         "{{replica}} {{type}}"),
        (f"sum by (replica, op) ({rate('router_kv_events_blocks_total')})",
         "{{replica}} blocks {{op}}"),
    ])  # fmt: skip
    d.panel("Event stream trouble", [
        (f"sum by (replica) ({rate('router_kv_events_gaps_total', 'increase')})",
         "{{replica}} gaps"),
        (f"sum by (replica, reason) ({rate('router_kv_events_dropped_total', 'increase')})",
         "{{replica}} dropped: {{reason}}"),
        (f"sum by (replica, reason) ({rate('router_kv_events_resyncs_total', 'increase')})",
         "{{replica}} resync: {{reason}}"),
    ])  # fmt: skip
    d.panel("Index latency (p99)", [
        (quantile(0.99, "router_index_lookup_seconds_bucket", by="backend"),
         "lookup {{backend}}"),
        (quantile(0.99, "router_index_write_seconds_bucket", by="backend"),
         "write {{backend}}"),
    ], unit="s")  # fmt: skip
    d.panel("Index trust per replica", [
        ("min by (replica) (router_kv_index_trust)", "{{replica}}"),
    ], unit="percentunit", bounds=SHARE, desc=(
        "The factor the kv scoring applies to predicted hits: lowered by event lag, gaps, "
        "restarts and disagreeing receipts."
    ))  # fmt: skip


def _errors(d: Layout) -> None:
    d.row("Errors")
    d.panel("Upstream failures by outcome", [
        (f"sum by (replica, outcome) ({rate(UPSTREAM_FAILED)})", "{{replica}} {{outcome}}"),
        (f"sum by (replica) ({rate('router_failovers_total')})", "{{replica}} failover"),
    ], unit="reqps")  # fmt: skip
    d.panel("Client-facing errors and health", [
        (f"sum by (endpoint, status) ({rate(CLIENT_ERRORS)})", "{{endpoint}} {{status}}"),
        (f"sum({rate('router_client_disconnects_total')})", "client disconnects"),
        (f"sum by (replica, state) ({rate('router_health_transitions_total', 'increase')})",
         "{{replica}} -> {{state}}"),
        (f"sum by (replica) ({rate('router_scrape_failures_total')})",
         "{{replica}} scrape failures"),
        (f"sum by (op) ({rate('router_index_unavailable_total')})",
         "index unavailable: {{op}}"),
    ])  # fmt: skip
    d.panel("Replica health as seen by each router", [
        ("router_replica_healthy", "{{instance}} -> {{replica}}"),
    ], bounds=SHARE)  # fmt: skip


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    d = Layout()
    for section in (_cache, _routing, _latency, _horizon, _load, _index, _errors):
        section(d)
    return {
        "uid": "kvroute", "title": "kvroute", "tags": ["kvroute", "vllm"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": False,
        "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []}, "annotations": {"list": []}, "links": [],
        "description": (
            "KV-cache-aware routing with kvroute: cache hits, routing decisions, latency, "
            "load, index health and errors. Series: router_* from kvroute routers, vllm:* "
            "from the replicas."
        ),
        "panels": d.panels,
    }  # fmt: skip


def render() -> str:
    """The file's exact text."""
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    """Write the dashboard file (``--check``: only say whether it is current)."""
    text = render()
    if sys.argv[1:] == ["--check"]:
        current = OUT.read_text(encoding="utf-8") == text
        print("up to date" if current else f"{OUT} is stale: run {__file__}")
        return 0 if current else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
