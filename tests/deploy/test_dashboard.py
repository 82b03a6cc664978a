"""Grafana provisioning and the kvroute dashboard, checked against what is really exported.

* Provisioning: the datasource points at the compose Prometheus and carries the uid the
  dashboard refers to; the dashboard provider reads the folder compose mounts.
* The dashboard file is what ``deploy/grafana/build_dashboard.py`` writes, and its
  layout is well-formed (unique ids, panels on the 24-column grid without overlaps, one
  query per refId).
* Every query parses as PromQL, and every metric it names is exported: ``router_*`` names
  by a running router and ``vllm:*`` names by a running simulated replica, both started
  here and scraped over HTTP, or (for series only real vLLM has) listed in vLLM 0.32's
  ``PrometheusStatLogger`` (``docs/vllm-interfaces.md`` section 5).  Label matchers on a
  scraped series must name labels that series carries (or that Prometheus adds).
* The panels cover what the issue asks for: TTFT from the router's and the replicas' view,
  decisions by reason, cached-token share, load, errors.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from replica.vllm.tiny_tokenizer import build_tokenizer

VLLM_DOCUMENTED = {
    # vLLM 0.32 PrometheusStatLogger, exposed names (docs/vllm-interfaces.md section 5).
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached_by_source_total",
    "vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total",
    "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:request_success_total",
    "vllm:cache_config_info",
    *(
        f"{h}{suffix}"
        for h in (
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        )
        for suffix in ("_bucket", "_sum", "_count")
    ),
}  # fmt: skip
TARGET_LABELS = {"instance", "job", "replica", "le"}
"""Labels Prometheus adds to every scraped series (``replica`` on the vLLM job)."""
REQUIRED = {
    "router_ttfb_seconds_bucket": "TTFT, router's view",
    "vllm:time_to_first_token_seconds_bucket": "TTFT, replicas' view",
    "router_decisions_total": "decisions by reason",
    "vllm:prefix_cache_hits_total": "cached-token share",
    "router_queued_prefill_tokens": "per-replica load",
    "router_upstream_requests_total": "errors",
    "router_receipt_prompt_tokens_total": "cached-token share and prefill tokens saved",
    "router_kv_predicted_cached_tokens_total": "predicted vs actual cached tokens",
    "router_session_turns_total": "stickiness of later turns",
    "router_eviction_horizon_seconds": "eviction horizon",
    "router_session_think_time_seconds_bucket": "think time",
    "router_index_blocks": "index size",
    "router_kv_events_receive_lag_seconds": "event lag",
}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


# --- exported names ---------------------------------------------------------------------------


@dataclass
class Exported:
    """Series names (as PromQL sees them) and each one's label names, from a scrape."""

    labels: dict[str, set[str]] = field(default_factory=dict)

    def add_scrape(self, text: str) -> None:
        """Record every family (even one without samples yet) and every sample."""
        for family in text_string_to_metric_families(text):
            for name in _series_names(family.name, family.type):
                self.labels.setdefault(name, set())
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)


def _series_names(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [f"{name}_total", f"{name}_created"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"]
    if kind == "summary":
        return [name, f"{name}_sum", f"{name}_count", f"{name}_created"]
    return [name]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback
        status: int = resp.status
        return status, resp.read()


def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if _get(url, timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {deadline_s} s")


def _kvroute(log: Path, *argv: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvroute.cli", *argv], stdout=out, stderr=subprocess.STDOUT
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """Scrape a live simulated replica and a live router (``kv`` policy) in front of it,
    after a two-turn conversation went through.  Their logs are in the temporary folder."""
    logs = tmp_path_factory.mktemp("scrape")
    tokenizer = build_tokenizer(logs / "tokenizer", template="llama3")
    sim_port, router_port = _free_port(), _free_port()
    sim = _kvroute(
        logs / "sim.log", "sim", "--host", "127.0.0.1", "--port", str(sim_port),
        "--model", "tiny-llama", "--tokenizer", str(tokenizer), "--block-size", "16",
        "--time-scale", "0",
    )  # fmt: skip
    router: subprocess.Popen[bytes] | None = None
    try:
        _wait_http(f"http://127.0.0.1:{sim_port}/health", sim)
        config = logs / "router.yaml"
        config.write_text(yaml.safe_dump({
            "policy": "kv",
            "replicas": [{"id": "sim-0", "url": f"http://127.0.0.1:{sim_port}"}],
            "scoring": {"models": [
                {"name": "tiny-llama", "tokenizer": str(tokenizer), "block_size": 16},
            ]},
        }), encoding="utf-8")  # fmt: skip
        router = _kvroute(
            logs / "router.log", "serve", "--host", "127.0.0.1", "--port", str(router_port),
            "--config", str(config),
        )  # fmt: skip
        _wait_http(f"http://127.0.0.1:{router_port}/ready", router)
        _chat(router_port, sim_port)
        found = Exported()
        found.add_scrape(_get(f"http://127.0.0.1:{sim_port}/metrics")[1].decode())
        found.add_scrape(_get(f"http://127.0.0.1:{router_port}/metrics")[1].decode())
        yield found
    finally:
        if router is not None:
            _stop(router)
        _stop(sim)


def _chat(router_port: int, sim_port: int) -> None:
    import json

    _, models = _get(f"http://127.0.0.1:{sim_port}/v1/models")
    model = json.loads(models)["data"][0]["id"]
    messages = [
        {"role": "system", "content": "You answer questions about caches. " * 8},
        {"role": "user", "content": "Hello, how is the cache today?"},
    ]
    for _ in range(2):
        body = json.dumps({"model": model, "max_tokens": 4, "messages": messages}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{router_port}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json", "X-Session-ID": "dashboard"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            assert resp.status == 200
            answer = json.loads(resp.read())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And tomorrow?"}]
        time.sleep(0.3)  # let the KV events of the first turn reach the index


# --- queries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    """One vector selector in a query."""

    name: str
    labels: frozenset[str]


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in a PromQL expression (Grafana variables substituted)."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    found: list[Selector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = frozenset(m.name for m in node.matchers.matchers if m.name != "__name__")
            assert node.name, f"a selector without a metric name in {expr!r}"
            found.append(Selector(node.name, labels))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query of the dashboard."""
    return [
        (p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])
    ]


# --- tests ------------------------------------------------------------------------------------


def test_datasource_is_the_compose_prometheus(
    repo: Path, services: dict[str, dict[str, Any]], dashboard: dict[str, Any]
) -> None:
    config = yaml.safe_load(
        (repo / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text("utf-8")
    )
    (source,) = config["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    refs = [p["datasource"] for p in panels(dashboard) if "datasource" in p]
    refs += [t["datasource"] for p in panels(dashboard) for t in p.get("targets", [])]
    assert refs and all(r == {"type": "prometheus", "uid": source["uid"]} for r in refs)


def test_dashboard_provider_reads_the_mounted_folder(
    repo: Path, services: dict[str, dict[str, Any]]
) -> None:
    config = yaml.safe_load(
        (repo / "deploy/grafana/provisioning/dashboards/kvroute.yml").read_text("utf-8")
    )
    (provider,) = config["providers"]
    volumes = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in volumes
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/kvroute.json"


def test_dashboard_file_is_what_its_builder_writes(repo: Path) -> None:
    builder = runpy.run_path(str(repo / "deploy/grafana/build_dashboard.py"))
    current = (repo / "deploy/grafana/dashboards/kvroute.json").read_text("utf-8")
    assert current == builder["render"](), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_layout_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "kvroute" and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in panels(dashboard):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        area = {(x, y) for x in xs for y in ys}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] == "row":
            continue
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]


def test_every_query_is_valid_promql(dashboard: dict[str, Any]) -> None:
    assert queries(dashboard)
    for title, expr in queries(dashboard):
        try:
            assert selectors(expr), f"{title}: no series in {expr!r}"
        except ValueError as exc:
            pytest.fail(f"{title}: {expr!r} is not PromQL: {exc}")


def test_the_query_check_catches_a_wrong_name() -> None:
    with pytest.raises(ValueError):
        selectors("sum(rate(router_decisions_total[$__rate_interval]) ")
    assert selectors('rate(router_ttfb_second_bucket{replica="a"}[1m])') == [
        Selector("router_ttfb_second_bucket", frozenset({"replica"}))
    ]


def test_every_series_is_exported(dashboard: dict[str, Any], exported: Exported) -> None:
    missing: list[str] = []
    for title, expr in queries(dashboard):
        for sel in selectors(expr):
            if sel.name in exported.labels:
                unknown = sel.labels - exported.labels[sel.name] - TARGET_LABELS
                if exported.labels[sel.name] and unknown:
                    missing.append(f"{title}: {sel.name} has no label(s) {sorted(unknown)}")
            elif sel.name.startswith("vllm:") and sel.name in VLLM_DOCUMENTED:
                continue
            else:
                missing.append(f"{title}: {sel.name} is not exported")
    assert not missing, "\n".join(missing)


def test_the_dashboard_covers_the_issue(dashboard: dict[str, Any]) -> None:
    used = {sel.name for _, expr in queries(dashboard) for sel in selectors(expr)}
    absent = {name: why for name, why in REQUIRED.items() if name not in used}
    assert not absent, absent


def test_the_live_scrape_saw_both_sides(exported: Exported) -> None:
    names = set(exported.labels)
    assert any(n.startswith("router_") for n in names)
    assert any(n.startswith("vllm:") for n in names)
    # The requests that went through left samples, with their labels: so the label
    # matchers of the dashboard were checked against real label sets.
    assert "replica" in exported.labels["router_ttfb_seconds_bucket"]
    assert exported.labels["router_upstream_requests_total"] >= {"replica", "outcome"}
    assert exported.labels["router_receipt_prompt_tokens_total"] >= {"replica", "kind"}
    assert exported.labels["router_receipts_total"] >= {"replica", "outcome"}
    assert exported.labels["router_session_turns_total"] >= {"policy", "placement"}
    assert exported.labels["router_decisions_total"] >= {"policy", "reason"}
