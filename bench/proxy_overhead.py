"""Proxy-overhead benchmark: direct-to-replica against through-the-router, in one run.

``python -m bench.proxy_overhead [--replicas N] [--out FILE] [--phase-s S]``

* N fake replicas that answer at once run in one child process (raw asyncio + httptools,
  so they cost little); the router is started as a child process with ``kvroute serve``
  (this module never imports ``router``: it talks HTTP only).
* The body is a realistic multi-turn chat: a ~1,500-token system prompt and ten turns,
  about 25 KB of JSON; streaming and non-streaming.
* The load generator is a lean keep-alive HTTP/1.1 client on raw asyncio streams (uvloop),
  one connection per concurrent worker, so it measures the router, not itself.
* On a machine with 2+ CPUs the router is pinned to CPU 1 and the load generator and
  replicas to CPU 0 ("the load generator on the other core"); ``--no-pin`` turns it off.

Measured: at concurrency 1, latency p50/p99 direct and routed and the added latency; for
streams also time to first body byte (TTFB); at concurrency 32 and 128, requests/s direct
and routed.  Prints a table with ratios and writes JSON (``--out``).  Bounded: every
phase runs for ``--phase-s`` seconds, ``--rounds`` interleaved rounds per cell with the
best kept and the median printed next to it (defaults 1.2 s x 3: the whole run takes
about a minute).

Why rounds differ: on a shared 2-CPU machine other processes take CPU time from the
router's core.  Every router round therefore also reports the router's CPU per request,
its share of its core (``cpu_share``: below ~0.95 it was not running all the time, so
it was preempted or starved of load), the load generator's and replicas' share of theirs
(``gen_share``: near 1.0 the load side is the limit) and the CPU time all other processes
used meanwhile (``others_cpu``, in cores).  A slow round with a high ``others_cpu`` and a
router CPU per request like the fast rounds' was interference, not the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.overhead_upstreams import chat_body


# --------------------------------------------------------------------------- client
class _Conn:
    """One keep-alive HTTP/1.1 connection; requests are pre-built bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> _Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, payload: bytes) -> tuple[float, float]:
        """Send one request; returns (latency, time to first body byte)."""
        t0 = time.perf_counter()
        self.writer.write(payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad response: {head[:80]!r}")
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i >= 0:
            n = int(lower[i + 15:lower.index(b"\r\n", i)])
            await self.reader.readexactly(n)
            t = time.perf_counter() - t0
            return t, t
        # chunked
        ttfb = 0.0
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if not ttfb:
                ttfb = time.perf_counter() - t0
            await self.reader.readexactly(size + 2)
            if size == 0:
                return time.perf_counter() - t0, ttfb

    def close(self) -> None:
        self.writer.close()


def _request_bytes(port: int, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:" + str(port).encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


@dataclass
class PhaseResult:
    """One measured phase."""

    target: str
    stream: bool
    concurrency: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    ttfb_p50_ms: float
    router_cpu_us_per_request: float | None = None
    """Router process CPU (user + system) per request: robust to a busy machine, and
    ``1e6 / value`` is the rate one dedicated core would sustain."""
    cpu_share: float | None = None
    """Router CPU seconds per wall second (1.0: it ran all the time on its core)."""
    gen_share: float | None = None
    """Load generator plus replicas, CPU seconds per wall second (their core)."""
    others_cpu: float | None = None
    """CPU seconds per wall second used by every other process on the machine."""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pid: int) -> float:
    """``_cpu_seconds`` of ``pid`` and every live descendant (``kvroute serve --workers``:
    the supervisor and its workers)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            total += _cpu_seconds(p)
            todo += [int(c) for c in
                     Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _machine_busy_seconds() -> float:
    """CPU time every process on the machine has used so far (``/proc/stat``: all but
    idle and iowait), in seconds."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class _CpuWatch:
    """CPU used by the router, by the load side (this process and the replicas) and by
    everything else, between ``__init__`` and ``stop``."""

    def __init__(self, router_pid: int, load_pids: list[int]) -> None:
        self._router = router_pid
        self._load = load_pids
        self._t0 = time.perf_counter()
        self._r0 = _tree_cpu_seconds(router_pid)
        self._l0 = sum(_cpu_seconds(p) for p in load_pids)
        self._m0 = _machine_busy_seconds()

    def stop(self) -> tuple[float, float, float, float]:
        """``(router CPU s, router share, load-side share, others' CPU in cores)``."""
        wall = time.perf_counter() - self._t0
        router = _tree_cpu_seconds(self._router) - self._r0
        load = sum(_cpu_seconds(p) for p in self._load) - self._l0
        machine = _machine_busy_seconds() - self._m0
        return router, router / wall, load / wall, max(0.0, machine - router - load) / wall


async def _phase(ports: list[int], target: str, body: bytes, stream: bool, concurrency: int,
                 seconds: float, cpu_pid: int | None = None,
                 load_pids: list[int] | None = None) -> PhaseResult:
    conns = [await _Conn.open(ports[i % len(ports)]) for i in range(concurrency)]
    payloads = [_request_bytes(ports[i % len(ports)], body) for i in range(concurrency)]
    lat: list[float] = []
    ttfbs: list[float] = []
    warm_until = time.perf_counter() + min(0.3, seconds / 5)
    # warm-up: not recorded
    async def run(i: int, until: float, record: bool) -> None:
        conn, payload = conns[i], payloads[i]
        while time.perf_counter() < until:
            t, f = await conn.request(payload)
            if record:
                lat.append(t)
                ttfbs.append(f)

    elapsed, cpu, share, gen, others = await timed_run(
        run, concurrency, warm_until, seconds, lat, cpu_pid, load_pids or [])
    for c in conns:
        c.close()
    lat.sort()
    ttfbs.sort()
    return PhaseResult(target, stream, concurrency, len(lat), elapsed, len(lat) / elapsed,
                       _pct(lat, 50) * 1e3, _pct(lat, 99) * 1e3, _pct(ttfbs, 50) * 1e3, cpu,
                       share, gen, others)


async def timed_run(
    run: Callable[[int, float, bool], Awaitable[None]], concurrency: int, warm_until: float,
    seconds: float, lat: list[float], cpu_pid: int | None, load_pids: list[int],
) -> tuple[float, float | None, float | None, float | None, float | None]:
    """Run ``run(i, until, record)`` on every connection: unrecorded until ``warm_until``,
    then ``seconds`` recorded (into ``lat``), watching the router's CPU when ``cpu_pid``
    is given.  ``(elapsed s, router CPU us per request, router share, load-side share,
    others' CPU in cores)``; the CPU figures are ``None`` without ``cpu_pid``."""
    await asyncio.gather(*(run(i, warm_until, False) for i in range(concurrency)))
    watch = _CpuWatch(cpu_pid, [os.getpid(), *load_pids]) if cpu_pid is not None else None
    t0 = time.perf_counter()
    await asyncio.gather(*(run(i, t0 + seconds, True) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if watch is None:
        return elapsed, None, None, None, None
    router_s, share, gen, others = watch.stop()
    return elapsed, router_s / max(1, len(lat)) * 1e6, share, gen, others


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


# --------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not answer {path} with 200")


def _pin(pid: int, cpus: set[int], enabled: bool) -> None:
    if enabled and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cpus)


async def _measure(replica_ports: list[int], router_port: int, phase_s: float, rounds: int,
                   router_pid: int, replicas_pid: int) -> tuple[list[PhaseResult],
                                                              list[PhaseResult]]:
    """Every (mode, concurrency) cell: ``rounds`` interleaved direct/router phases; the
    best round of each target is kept (noise from other processes only slows things) and
    every round is returned too (``(best, all)``)."""
    results: list[PhaseResult] = []
    every: list[PhaseResult] = []
    for stream in (False, True):
        body = chat_body(stream)
        for concurrency in (1, 32, 128):
            runs: dict[str, list[PhaseResult]] = {"direct": [], "router": []}
            for _ in range(rounds):
                for target, ports in (("direct", replica_ports), ("router", [router_port])):
                    pid = router_pid if target == "router" else None
                    runs[target].append(
                        await _phase(ports, target, body, stream, concurrency, phase_s, pid,
                                     [replicas_pid]))
            for target, phases in runs.items():
                every.extend(phases)
                best = (min(phases, key=lambda r: r.p50_ms) if concurrency == 1
                        else max(phases, key=lambda r: r.rps))
                results.append(best)
                median = statistics.median(r.rps for r in phases)
                print(f"  {'stream' if stream else 'plain ':6} c={concurrency:<3} {target:6} "
                      f"{best.rps:8.0f} req/s  p50 {best.p50_ms:6.3f} ms  "
                      f"p99 {best.p99_ms:7.3f} ms  ttfb p50 {best.ttfb_p50_ms:6.3f} ms  "
                      f"(rounds: {', '.join(f'{r.rps:.0f}' for r in phases)} req/s, "
                      f"median {median:.0f})"
                      + (f"  router CPU {best.router_cpu_us_per_request:.0f} us/req"
                         if best.router_cpu_us_per_request is not None else ""),
                      flush=True)
                if target == "router":
                    print("         rounds: " + "; ".join(
                        f"{r.rps:.0f} req/s {r.router_cpu_us_per_request:.0f} us/req "
                        f"cpu_share {r.cpu_share:.2f} gen_share {r.gen_share:.2f} "
                        f"others_cpu {r.others_cpu:.2f}"
                        for r in phases
                        if r.router_cpu_us_per_request is not None and r.cpu_share is not None
                        and r.gen_share is not None and r.others_cpu is not None), flush=True)
    return results, every


def _summary(results: list[PhaseResult], every: list[PhaseResult]) -> dict[str, Any]:
    def get(target: str, stream: bool, c: int) -> PhaseResult:
        return next(r for r in results
                    if r.target == target and r.stream == stream and r.concurrency == c)

    out: dict[str, Any] = {}
    for stream in (False, True):
        key = "stream" if stream else "non_stream"
        d1, r1 = get("direct", stream, 1), get("router", stream, 1)
        entry: dict[str, Any] = {
            "added_p50_ms": r1.p50_ms - d1.p50_ms,
            "added_p99_ms": r1.p99_ms - d1.p99_ms,
            "latency_ratio_p50": r1.p50_ms / d1.p50_ms,
        }
        if stream:
            entry["ttfb_direct_p50_ms"] = d1.ttfb_p50_ms
            entry["ttfb_router_p50_ms"] = r1.ttfb_p50_ms
            entry["added_ttfb_p50_ms"] = r1.ttfb_p50_ms - d1.ttfb_p50_ms
        for c in (32, 128):
            d, r = get("direct", stream, c), get("router", stream, c)
            entry[f"rps_c{c}_direct"] = d.rps
            entry[f"rps_c{c}_router"] = r.rps
            entry[f"rps_c{c}_ratio"] = r.rps / d.rps
            rounds = [x.rps for x in every
                      if x.target == "router" and x.stream == stream and x.concurrency == c]
            entry[f"rps_c{c}_router_rounds"] = rounds
            entry[f"rps_c{c}_router_worst"] = min(rounds, default=r.rps)
            if r.router_cpu_us_per_request:
                entry[f"router_cpu_us_per_request_c{c}"] = r.router_cpu_us_per_request
                entry[f"rps_c{c}_router_one_core"] = 1e6 / r.router_cpu_us_per_request
        out[key] = entry
    return out


def _calibrate(phase_s: float, pin: bool) -> PhaseResult:
    """Bare uvicorn's CPU per request at concurrency 32 (same body, same client)."""
    import uvloop

    port = _free_port()
    echo = subprocess.Popen(
        [sys.executable, "-c", "import sys; from bench.overhead_upstreams import serve_echo; "
         "serve_echo(int(sys.argv[1]))", str(port)])
    try:
        _pin(echo.pid, {1}, pin)
        _wait_http(port, "/")
        result = uvloop.run(_phase([port], "bare_uvicorn", chat_body(False), False, 32, phase_s,
                                   echo.pid))
    finally:
        echo.send_signal(signal.SIGTERM)
        echo.wait(timeout=10)
    print(f"  calibration: bare uvicorn c=32 {result.rps:.0f} req/s, "
          f"CPU {result.router_cpu_us_per_request:.0f} us/req", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.proxy_overhead",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--replicas", type=int, default=2, help="fake replicas (default 2)")
    p.add_argument("--phase-s", type=float, default=1.2,
                   help="seconds per measured phase (default 1.2)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved direct/router rounds per cell; the best is kept "
                   "(default 3; 12 cells x rounds phases in all)")
    p.add_argument("--policy", default="round_robin",
                   help="the router's policy (default round_robin: the proxy's own cost)")
    p.add_argument("--out", default="/tmp/kvroute-proxy-overhead.json",
                   help="where to write the JSON results")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--workers", type=int, default=1,
                   help="kvroute serve --workers N (default 1; with N > 1 the router's "
                   "processes are not pinned, and its CPU is the whole process tree's)")
    args = p.parse_args(argv)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2

    replica_ports = [_free_port() for _ in range(args.replicas)]
    router_port = _free_port()
    here = os.getpid()
    _pin(here, {0}, pin)
    replicas = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from bench.overhead_upstreams import serve_replicas; "
         "serve_replicas([int(p) for p in sys.argv[1:]])", *map(str, replica_ports)],
        stdout=subprocess.PIPE,
    )
    kvroute = str(Path(sys.executable).with_name("kvroute"))
    cmd = [kvroute, "serve", "--host", "127.0.0.1", "--port", str(router_port),
           "--log-level", "warning", "--policy", args.policy]
    if args.workers > 1:
        cmd += ["--workers", str(args.workers)]
    for port in replica_ports:
        cmd += ["--replica", f"http://127.0.0.1:{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    router = subprocess.Popen(cmd, env=env)
    try:
        _pin(replicas.pid, {0}, pin)
        _pin(router.pid, {1}, pin and args.workers == 1)
        for port in replica_ports:
            _wait_http(port, "/health")
        _wait_http(router_port, "/ready")
        body_kb = len(chat_body(False)) / 1024
        print(f"proxy overhead: {args.replicas} replicas, body {body_kb:.1f} KB, "
              f"{args.rounds} x {args.phase_s}s per cell and target, policy {args.policy}, "
              f"workers {args.workers}, pinned={pin}, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        import uvloop

        load_before = os.getloadavg()
        results, every = uvloop.run(_measure(replica_ports, router_port, args.phase_s,
                                             args.rounds, router.pid, replicas.pid))
        load_after = os.getloadavg()
        calibration = _calibrate(args.phase_s, pin)
    finally:
        for proc in (router, replicas):
            proc.send_signal(signal.SIGTERM)
        for proc in (router, replicas):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if replicas.stdout is not None:
            replicas.stdout.close()
    summary = _summary(results, every)
    report = {
        "replicas": args.replicas, "phase_s": args.phase_s, "rounds": args.rounds,
        "policy": args.policy, "pinned": pin, "workers": args.workers,
        "loadavg_before": load_before, "loadavg_after": load_after,
        "body_bytes": len(chat_body(False)), "cpus": os.cpu_count(),
        "summary": summary, "phases": [asdict(r) for r in results],
        "rounds_all": [asdict(r) for r in every],
        "calibration_bare_uvicorn": asdict(calibration),
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print()
    for key, entry in summary.items():
        line = (f"{key:10}: added p50 {entry['added_p50_ms']:.3f} ms, p99 "
                f"{entry['added_p99_ms']:.3f} ms; c32 {entry['rps_c32_router']:.0f} req/s "
                f"({entry['rps_c32_ratio']:.2f}x direct, worst round "
                f"{entry['rps_c32_router_worst']:.0f}); c128 "
                f"{entry['rps_c128_router']:.0f} req/s ({entry['rps_c128_ratio']:.2f}x)")
        if "rps_c32_router_one_core" in entry:
            line += (f"; router CPU {entry['router_cpu_us_per_request_c32']:.0f} us/req at c32 "
                     f"(= {entry['rps_c32_router_one_core']:.0f} req/s on a dedicated core)")
        if "added_ttfb_p50_ms" in entry:
            line += f"; ttfb p50 +{entry['added_ttfb_p50_ms']:.3f} ms"
        print(line)
    bare = calibration.router_cpu_us_per_request or float("nan")
    for key, entry in summary.items():
        ratio = entry["router_cpu_us_per_request_c32"] / bare
        entry["router_cpu_vs_bare_uvicorn_c32"] = ratio
        print(f"{key:10}: router CPU per request = {ratio:.1f}x bare uvicorn's ({bare:.0f} us "
              f"here now)")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
