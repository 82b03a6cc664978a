"""The benchmarks under ``bench/`` still run: each at a tiny size, as a user runs it
(``python -m bench.X``), writing its JSON.  Nothing here asserts a speed: the figures of
a run this small mean nothing; what is checked is that every measured series is there,
so a benchmark cannot rot unnoticed between the sessions that take its numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(module: str, *args: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_index_bench(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "index.json"
    r = _run("bench.index_bench", "--blocks", "20000", "--lookups", "20",
             "--redis-url", redis_url, "--redis-budget", "10", "--out", str(out), out=out)
    for backend in ("memory", "redis"):
        assert r[backend]["indexed_blocks"] == 20_000
        assert r[backend]["ingest_blocks_per_s"] > 0
        assert r[backend]["lookup"]["median_us"] > 0
    assert r["memory_bytes_per_block"] > 0 and r["redis"]["bytes_per_block"] > 0


def test_render_bench(tmp_path: Path) -> None:
    out = tmp_path / "render.json"
    r = _run("bench.render_bench", "--turns", "2,3", "--reps", "2", "--out", str(out),
             out=out)
    rows = r["rows"]
    assert [row["turns"] for row in rows] == [2, 3]
    for row in rows:
        assert row["cold_cpu"]["median_ms"] > 0 and row["warm_cpu"]["median_ms"] > 0
        assert row["new_tokens_warm"] > 0


def test_proxy_overhead(tmp_path: Path) -> None:
    out = tmp_path / "proxy.json"
    r = _run("bench.proxy_overhead", "--phase-s", "0.1", "--rounds", "1", "--out", str(out),
             out=out)
    assert r["body_bytes"] > 20_000  # the multi-turn chat body of the issue
    assert set(r["summary"]) >= {"stream", "non_stream"}


def test_sim_fleet_bench(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    r = _run("bench.sim_fleet_bench", "--replicas", "2", "--seconds", "1",
             "--capacity-requests", "50", "--http-seconds", "1", "--out", str(out), out=out)
    assert {"capacity", "core_realtime", "http"} <= set(r)


def test_kv_overhead(tmp_path: Path, llama3_dir: Path) -> None:
    out = tmp_path / "kv.json"
    r = _run("bench.kv_overhead", "--replicas", "2", "--phase-s", "0.2", "--rounds", "1",
             "--tokenizer", str(llama3_dir), "--out", str(out), out=out)
    assert set(r["summary"]) == {"round_robin", "session", "kv"}
    for row in r["summary"].values():
        assert row["rps_c32"] > 0 and row["cpu_us_per_request_c32"] > 0
    # the index was populated by the replicas' events: kv routed on hits, nothing else
    kv = {k: v for k, v in r["decisions"].items() if k.startswith("kv/")}
    assert set(kv) == {"kv/kv_hit"} and kv["kv/kv_hit"] > 0
    # the kv policy's own time, by stage, from the router's histograms
    stages = r["kv_stages_us"]
    assert {"render", "lookup", "score", "other", "route"} <= set(stages)
    assert all(stages[k] > 0 for k in ("render", "lookup", "score", "route"))
    assert stages["route"] >= stages["render"] + stages["lookup"] + stages["score"]
