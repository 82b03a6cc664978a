"""How many simulated requests a 16-replica ``kvroute sim`` fleet handles on this box.

``python -m bench.sim_fleet_bench [--replicas 16] [--procs 2] [--rate 500] ...``

Three measurements, each in child processes (``python -m replica.sim.fleet ...``; bench
never imports ``replica``), with bounded run time:

1. **capacity**: one engine core (pool + scheduler, no HTTP) in virtual time, as fast as
   the CPU allows: simulated requests per CPU-second.  ``capacity / rate`` is how many
   replicas one core could carry at ``rate`` requests/s each.
2. **core, real time**: ``replicas`` engines split over ``procs`` processes at the
   default time scale (1.0, real time), each offered ``rate`` requests per wall second
   (open loop) for ``seconds``; reports completions per replica per wall second, whether
   every replica kept up (all done within 1 s after the offer ended), CPU used, and
   simulated TTFT percentiles (which grow if the engines fall behind).
3. **http**: ``replicas`` ``SimServer``s in ``procs`` processes, driven over loopback by
   this process (aiohttp, closed loop, ``--http-concurrency`` in flight per replica,
   non-streaming chat completions with ``max_tokens`` 8) for ``--http-seconds``; reports
   requests/s per replica, latency, errors, and CPU per request in the servers.  The
   servers run at ``--http-time-scale`` (default 0.01): at real time a closed loop is
   capped by Little's law (C in flight / ~80 ms simulated latency), which would measure
   the driver's concurrency rather than the servers.

Workload: 128-token prompts sharing a 96-token system prompt (engine) or chat messages
with a shared system message (HTTP), 8 output tokens, the ``default`` profile.

Prints a table and writes JSON to ``--out`` (default ``out/sim_fleet_bench.json``).
The numbers depend on what else runs on the box: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

TARGET_PER_REPLICA = 500.0
_FLEET = [sys.executable, "-m", "replica.sim.fleet"]


async def _run_json(argv: list[str], timeout: float) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{' '.join(argv)} timed out after {timeout}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Measurement 1 (see the module docstring)."""
    res = await _run_json(
        [*_FLEET, "core", "--virtual", "--requests", str(args.capacity_requests)], 120
    )
    res["replicas_per_core_at_rate"] = round(res["requests_per_cpu_s"] / args.rate, 1)
    return res


async def core_realtime(args: argparse.Namespace) -> dict[str, Any]:
    """Measurement 2."""
    per = args.replicas // args.procs
    runs = await asyncio.gather(*(
        _run_json([*_FLEET, "core", "--replicas", str(per), "--rate", str(args.rate),
                   "--seconds", str(args.seconds)], 60 + args.seconds * 4)
        for _ in range(args.procs)
    ))
    return {
        "replicas": per * args.procs,
        "procs": args.procs,
        "offered_per_replica_per_s": args.rate,
        "min_completed_per_replica_per_wall_s": min(
            r["completed_per_replica_per_wall_s"] for r in runs),
        "kept_up": all(r["kept_up"] for r in runs),
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs), 3),
        "cpu_us_per_request": round(
            1e6 * sum(r["cpu_seconds"] for r in runs) / sum(r["completed"] for r in runs), 1),
        "ttft_p50_sim_s": max(r["ttft_p50_sim_s"] for r in runs),
        "ttft_p99_sim_s": max(r["ttft_p99_sim_s"] for r in runs),
        "per_process": runs,
    }


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _start_servers(
    args: argparse.Namespace, tokenizer: str
) -> tuple[list[asyncio.subprocess.Process], list[str]]:
    per = args.replicas // args.procs
    procs: list[asyncio.subprocess.Process] = []
    urls: list[str] = []
    for _ in range(args.procs):
        proc = await asyncio.create_subprocess_exec(
            *_FLEET, "serve", "--replicas", str(per), "--tokenizer", tokenizer,
            "--time-scale", str(args.http_time_scale),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        procs.append(proc)
        assert proc.stdout is not None
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                raise RuntimeError("sim_fleet serve exited early")
            msg = json.loads(line)
            if msg.get("ready"):
                break
            urls.append(msg["url"])
    return procs, urls


async def _drive(url: str, http: aiohttp.ClientSession, stop_at: float, worker: int,
                 lat: list[float], errors: list[int]) -> int:
    loop = asyncio.get_running_loop()
    rng = random.Random(worker)
    system = {"role": "system", "content": "You are a helpful simulated assistant. " * 6}
    done = 0
    while loop.time() < stop_at:
        body = {
            "model": "sim-model", "max_tokens": 8,
            "messages": [system, {"role": "user",
                                  "content": f"question {rng.randrange(10**6)} about things"}],
        }
        t0 = loop.time()
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    errors.append(resp.status)
                    continue
        except (aiohttp.ClientError, TimeoutError):
            errors.append(-1)
            continue
        lat.append(loop.time() - t0)
        done += 1
    return done


async def http_path(args: argparse.Namespace) -> dict[str, Any]:
    """Measurement 3."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = await _run_json_text([*_FLEET, "tokenizer", "--out", tmp], 60)
        procs, urls = await _start_servers(args, tok)
        try:
            cpu0 = [_cpu_seconds(p.pid) for p in procs]
            drv0 = time.process_time()
            loop = asyncio.get_running_loop()
            lat: list[float] = []
            errors: list[int] = []
            conn = aiohttp.TCPConnector(limit=0, limit_per_host=args.http_concurrency)
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
                t0 = loop.time()
                stop_at = t0 + args.http_seconds
                per_url = await asyncio.gather(*(
                    asyncio.gather(*(_drive(u, http, stop_at, i * 100 + w, lat, errors)
                                     for w in range(args.http_concurrency)))
                    for i, u in enumerate(urls)
                ))
                wall = loop.time() - t0
            server_cpu = sum(_cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0, strict=True))
            driver_cpu = time.process_time() - drv0
        finally:
            for p in procs:
                if p.stdin is not None:
                    p.stdin.close()
            for p in procs:
                try:
                    await asyncio.wait_for(p.wait(), 10)
                except TimeoutError:
                    p.kill()
                    await p.wait()
    counts = [sum(x) for x in per_url]
    total = sum(counts)
    lat.sort()

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))], 4) if lat else float("nan")

    return {
        "replicas": len(urls),
        "procs": args.procs,
        "concurrency_per_replica": args.http_concurrency,
        "time_scale": args.http_time_scale,
        "wall_seconds": round(wall, 3),
        "requests": total,
        "errors": len(errors),
        "requests_per_s_total": round(total / wall, 1),
        "min_requests_per_replica_per_s": round(min(counts) / wall, 1),
        "latency_p50_s": pct(0.5),
        "latency_p99_s": pct(0.99),
        "server_cpu_seconds": round(server_cpu, 3),
        "server_cpu_us_per_request": round(1e6 * server_cpu / max(total, 1), 1),
        "driver_cpu_seconds": round(driver_cpu, 3),
    }


async def _run_json_text(argv: list[str], timeout: float) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed")
    return out.decode().strip().splitlines()[-1]


def _table(result: dict[str, Any]) -> str:
    rows = [("measurement", "figure", "value", f"target {TARGET_PER_REPLICA:.0f}/replica")]
    cap = result.get("capacity")
    if cap:
        rows.append(("capacity (1 core, virtual time)", "requests / CPU-s",
                     f"{cap['requests_per_cpu_s']:.0f}",
                     f"{cap['replicas_per_core_at_rate']} replicas/core"))
    core = result.get("core_realtime")
    if core:
        ok = core["kept_up"] and core["min_completed_per_replica_per_wall_s"] >= \
            0.97 * TARGET_PER_REPLICA
        rows.append((f"core, real time ({core['replicas']} replicas / {core['procs']} procs)",
                     "req/s per replica (min)",
                     f"{core['min_completed_per_replica_per_wall_s']:.0f}",
                     "met" if ok else "NOT met"))
        rows.append(("", "CPU us / request", f"{core['cpu_us_per_request']:.0f}", ""))
        rows.append(("", "TTFT p50 / p99 (sim s)",
                     f"{core['ttft_p50_sim_s']:.3f} / {core['ttft_p99_sim_s']:.3f}", ""))
    web = result.get("http")
    if web:
        ok = web["min_requests_per_replica_per_s"] >= TARGET_PER_REPLICA
        rows.append((f"http ({web['replicas']} servers / {web['procs']} procs, loopback)",
                     "req/s per replica (min)", f"{web['min_requests_per_replica_per_s']:.0f}",
                     "met" if ok else "NOT met"))
        rows.append(("", "req/s total", f"{web['requests_per_s_total']:.0f}", ""))
        rows.append(("", "server CPU us / request", f"{web['server_cpu_us_per_request']:.0f}",
                     ""))
        rows.append(("", "latency p50 / p99 (s)",
                     f"{web['latency_p50_s']} / {web['latency_p99_s']}", ""))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected measurements one after another (they would compete for CPU)."""
    result: dict[str, Any] = {
        "target_per_replica_per_s": TARGET_PER_REPLICA,
        "loadavg_before": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    if not args.skip_capacity:
        result["capacity"] = await capacity(args)
    if not args.skip_core:
        result["core_realtime"] = await core_realtime(args)
    if not args.skip_http:
        result["http"] = await http_path(args)
    result["loadavg_after"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.sim_fleet_bench``."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_fleet_bench")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rate", type=float, default=TARGET_PER_REPLICA)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--capacity-requests", type=int, default=20_000)
    p.add_argument("--http-seconds", type=float, default=5.0)
    p.add_argument("--http-concurrency", type=int, default=8)
    p.add_argument("--http-time-scale", type=float, default=0.01,
                   help="the servers' time scale: at 1.0 a closed loop of C requests in "
                   "flight per replica is capped at C / latency, so the default runs 100x "
                   "faster to measure what HTTP and the CPU allow")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--skip-core", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--out", default="out/sim_fleet_bench.json")
    args = p.parse_args(argv)
    if args.replicas % args.procs:
        p.error("--replicas must be a multiple of --procs")
    result = asyncio.run(main_async(args))
    print(_table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
