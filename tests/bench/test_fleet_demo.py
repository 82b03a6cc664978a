"""The fleet stops every process it started, on errors and on cancellation; a tiny demo
runs end to end (real ``kvroute sim`` replicas and ``kvroute serve`` as children)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from bench.demo import DemoOptions, render_result, run_demo
from bench.fleet import Fleet, FleetError, FleetSpec


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_fleet_cleans_up_on_error_and_on_cancel(llama3_dir: Path) -> None:
    spec = FleetSpec(tokenizer=llama3_dir, replicas=1, num_blocks=128, time_scale=0.05)
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        async with Fleet(spec) as fleet:
            assert fleet.router_url is not None and len(fleet.replica_urls) == 1
            pids = fleet.pids
            assert len(pids) == 2 and all(alive(p) for p in pids)
            raise RuntimeError("boom")
    assert pids and not any(alive(p) for p in pids)

    started = asyncio.Event()
    seen: list[int] = []

    async def hold() -> None:
        async with Fleet(FleetSpec(tokenizer=llama3_dir, replicas=1, router=False)) as f:
            seen.extend(f.pids)
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen and not any(alive(p) for p in seen)


@pytest.mark.slow
async def test_a_router_started_after_a_reset_does_not_route_on_the_old_blocks(
    llama3_dir: Path,
) -> None:
    # A replica publishes its reset with its next engine step (as vLLM does); the fleet
    # runs that step, so the next target's router replays the reset and predicts nothing.
    import aiohttp

    spec = FleetSpec(tokenizer=llama3_dir, replicas=1, router=False, num_blocks=128,
                     time_scale=0.05)
    body = {"model": spec.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "tell me about blocks " * 40}]}

    async def send(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            predicted = int(resp.headers.get("x-kvroute-predicted-cached-tokens", "0"))
        return predicted, (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    async with Fleet(spec) as fleet, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with fleet.router("kv") as url:
            await send(http, url)
            for _ in range(100):  # until the replica's events reached the router
                predicted, cached = await send(http, url)
                if predicted > 0:
                    break
                await asyncio.sleep(0.1)
            assert predicted == cached > 0
        await fleet.reset_caches()
        async with fleet.router("kv") as url:
            assert await send(http, url) == (0, 0)


async def test_a_replica_that_cannot_start_is_reported(tmp_path: Path) -> None:
    spec = FleetSpec(tokenizer=tmp_path / "missing", replicas=1, router=False)
    with pytest.raises(FleetError, match="replica0"):
        async with Fleet(spec):
            pass


@pytest.mark.slow
async def test_tiny_demo_end_to_end(tmp_path: Path, llama3_dir: Path) -> None:
    out = tmp_path / "demo"
    shutil.copytree(llama3_dir, out / "tiny-model")
    opts = DemoOptions(
        out=out, replicas=2, policies=("round_robin", "kv"), sessions=4, turns=3,
        system_tokens=200, user_tokens=30, reply_tokens=60, tenants=2, arrival_rate=2.0,
        think_median_s=1.0, think_tail_median_s=4.0, num_blocks=256, time_scale=0.05,
        max_tokens=4, progress=False,
    )
    result = await run_demo(opts, say=lambda _: None)
    text = render_result(result)
    assert [s.name for s in result.summaries] == ["round_robin", "kv"], text
    rr, kv = result.summaries
    assert rr.requests == kv.requests == 12 and rr.errors == kv.errors == 0, text
    assert kv.ttft_source == "simulated" and kv.ttft_p50 is not None
    assert result.bounds is not None and result.bounds.pooled_optimal_saved > 0
    # The same prompts go through both policies; the KV-aware one keeps conversations on
    # their replica, except where a burst of arrivals made the load outweigh the better
    # hit (``kv_load``: the escape hatch, whose timing the demo's arrivals decide).
    assert rr.prompt_tokens == kv.prompt_tokens
    assert kv.stay_share is not None and rr.stay_share is not None
    assert kv.cached_share >= rr.cached_share and kv.stay_share >= rr.stay_share, text
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    last: dict[str, str] = {}
    for row in sorted((r for r in rows if r["target"] == "kv"), key=lambda r: r["sent_s"]):
        moved = row["session"] in last and row["replica"] != last[row["session"]]
        assert not moved or row["reason"] == "kv_load", (row, text)
        last[row["session"]] = row["replica"]
    doc = json.loads((out / "summary.json").read_text())
    assert {r["name"] for r in doc["runs"]} == {"round_robin", "kv"}
    for name in ("ttft-distribution.png", "ttft-by-turn.png", "results.jsonl", "trace.jsonl"):
        assert (out / name).stat().st_size > 0
    assert (out / "table.txt").read_text() == result.table + "\n"  # the printed table
    assert "bounds:" in text and "kv" in text
