"""The same trace against several routing targets on one simulated fleet, plus the bounds.

A target is a kvroute policy (a fresh ``kvroute serve --policy NAME`` in front of the
fleet, and the ``X-KVRoute-Policy`` header on every request), or a peer router started
from a command line (``PeerSpec``), or ``direct`` (the first replica alone, no router).
Before each target every replica's prefix cache is emptied (``POST
/reset_prefix_cache``) and the router is new, so every target starts from equal caches.
With ``--repeats``, each round of targets runs on a fresh fleet: the replicas' addresses
change, and with them every consistent-hash ring's assignment of sessions (a ring's
cached share moves by points with the assignment alone), so a median over repeats is
over several assignments.

The cache bounds (``bench.bounds``) need the exact token ids the replicas hash: they come
from the replica's own ``POST /tokenize`` for each turn's messages (the trace's fixed
replies make these the prompts every target sends; with ``replies="actual"`` the bounds
still use the trace's replies, so they are then estimates).  Each run is measured against
the bounds of the order its own requests were sent in (``arrival_bounds``), as the replay
does: a later turn leaves a think time after the previous reply, so the order depends on
the run's service times, and the trace's nominal times (which leave them out) bring a
conversation's turns closer together than any fleet can, and the pooled LRU figure up
with them.

Peer routers: sglang-router tries to download a tokenizer for the model a replica reports,
and nothing may leave the machine, so peers run only inside a loopback-only network
namespace, with the replicas and the client (``bench.netns``; the CLI re-executes itself
inside one).  A peer command is a template: ``{port}`` becomes its port and ``{workers}``
the replica URLs separated by spaces (``{workers_comma}``: by commas).
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from bench.bounds import Bounds, CacheRequest, cache_bounds
from bench.fleet import Fleet, FleetError, free_port
from bench.report import RunSummary, summarize
from bench.runner import ProgressFn, RequestResult, RunConfig, Runner
from bench.trace import TraceRequest, by_session, conversation

POLICIES: tuple[str, ...] = ("round_robin", "random", "least_loaded", "session", "kv")
"""kvroute's policies, in the order the demo runs them."""


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A peer router: a name, a command template, and the path that answers 200 when
    it is ready."""

    name: str
    command: str
    ready_path: str = "/health"

    @classmethod
    def parse(cls, text: str) -> PeerSpec:
        """``name=vllm;cmd=vllm-router --port {port} --worker-urls {workers};ready=/health``."""
        fields: dict[str, str] = {}
        for part in text.split(";"):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"peer spec part {part!r} is not key=value")
            fields[key.strip()] = value.strip()
        if "name" not in fields or "cmd" not in fields:
            raise ValueError(f"peer spec needs name= and cmd=: {text!r}")
        return cls(fields["name"], fields["cmd"], fields.get("ready", "/health"))

    def argv(self, port: int, workers: Sequence[str], aux: int | None = None) -> list[str]:
        """The command line for ``port`` and the replica URLs (``{aux}``: a second free
        port, for a peer's metrics listener)."""
        command = self.command if aux is None else self.command.replace("{aux}", str(aux))
        filled = command.format(
            port=port, workers=" ".join(workers), workers_comma=",".join(workers)
        )
        return shlex.split(filled)


@dataclass(frozen=True, slots=True)
class Target:
    """One thing to benchmark."""

    name: str
    policy: str | None = None
    peer: PeerSpec | None = None

    @property
    def kind(self) -> str:
        """``policy``, ``peer`` or ``direct``."""
        return "policy" if self.policy else ("peer" if self.peer else "direct")


@dataclass(slots=True)
class TargetRun:
    """The outcome of one target."""

    target: Target
    results: list[RequestResult]
    wall_s: float
    error: str | None = None


async def tokenize_trace(
    url: str, trace: Sequence[TraceRequest], *, model: str, max_tokens_cap: int | None = None,
    concurrency: int = 8,
) -> dict[tuple[str, int], CacheRequest]:
    """The trace's prompts as token ids (from the replica's ``/tokenize``) by session and
    turn, for ``bench.bounds`` (``arrival_bounds``).  A prompt the replica refuses as too
    long (HTTP 400) is left out: every target's request for it fails the same way."""
    jobs: list[tuple[TraceRequest, list[dict[str, Any]]]] = []
    for turns in by_session(trace).values():
        jobs.extend(zip(turns, conversation(turns), strict=True))
    out: dict[tuple[str, int], CacheRequest] = {}
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60.0)

    async def one(http: aiohttp.ClientSession, turn: TraceRequest,
                  messages: list[dict[str, Any]]) -> None:
        body = {"model": turn.model or model, "messages": messages,
                "add_generation_prompt": True}
        async with sem, http.post(url.rstrip("/") + "/tokenize", json=body) as resp:
            if resp.status == 400 and "context length" in await resp.text():
                return
            if resp.status != 200:
                raise FleetError(f"/tokenize failed (HTTP {resp.status}): "
                                 f"{(await resp.text())[:200]}")
            tokens = (await resp.json())["tokens"]
        gen = min(turn.max_tokens, max_tokens_cap or turn.max_tokens)
        out[(turn.session, turn.turn)] = CacheRequest(tokens, gen, turn.cache_salt)

    async with aiohttp.ClientSession(timeout=timeout) as http, asyncio.TaskGroup() as tg:
        for turn, messages in jobs:
            tg.create_task(one(http, turn, messages))
    return out


def arrival_bounds(
    prompts: Mapping[tuple[str, int], CacheRequest],
    results: Sequence[RequestResult],
    *,
    block_size: int,
    capacity: int,
    model: str,
) -> Bounds:
    """The cache bounds over the requests a run served, in the order it sent them.

    ``prompts`` are ``tokenize_trace``'s; a request that failed is left out, as it is
    from the run's own figures."""
    sent = sorted((r for r in results if r.ok and (r.session, r.turn) in prompts),
                  key=lambda r: (r.sent_s, r.session, r.turn))
    return cache_bounds([prompts[(r.session, r.turn)] for r in sent], block_size=block_size,
                        capacity=capacity, model=model)


async def run_summary(
    run: TargetRun, prompts: Mapping[tuple[str, int], CacheRequest], *, block_size: int,
    capacity: int, model: str, time_scale: float,
) -> RunSummary:
    """A run's figures, against the bounds of the order it sent its requests in."""
    bounds = await asyncio.to_thread(arrival_bounds, prompts, run.results,
                                     block_size=block_size, capacity=capacity, model=model)
    return summarize(run.target.name, run.results, time_scale=time_scale, bounds=bounds,
                     wall_s=round(run.wall_s, 2))


async def run_target(
    fleet: Fleet,
    target: Target,
    trace: Sequence[TraceRequest],
    base: RunConfig,
    progress: ProgressFn | None = None,
) -> TargetRun:
    """Reset the caches, bring the target up, replay the trace, take the target down."""
    await fleet.reset_caches()
    t0 = time.perf_counter()
    try:
        if target.policy is not None:
            async with fleet.router(target.policy) as url:
                cfg = replace(base, url=url, headers={**base.headers,
                                                      "X-KVRoute-Policy": target.policy})
                results = await _replay(cfg, trace, progress)
        elif target.peer is not None:
            port = free_port()
            argv = target.peer.argv(port, fleet.replica_urls, aux=free_port())
            async with fleet.peer(target.name, argv, port, target.peer.ready_path) as url:
                results = await _replay(replace(base, url=url), trace, progress)
        else:
            results = await _replay(replace(base, url=fleet.replica_urls[0]), trace, progress)
    except FleetError as exc:
        return TargetRun(target, [], time.perf_counter() - t0, error=str(exc).splitlines()[0])
    return TargetRun(target, results, time.perf_counter() - t0)


async def _replay(
    cfg: RunConfig, trace: Sequence[TraceRequest], progress: ProgressFn | None
) -> list[RequestResult]:
    async with Runner(cfg) as runner:
        return await runner.run(trace, progress)


async def run_targets(
    fleet: Fleet,
    targets: Sequence[Target],
    trace: Sequence[TraceRequest],
    base: RunConfig,
    progress_for: Callable[[Target], tuple[ProgressFn | None, Callable[[], None]]] | None = None,
) -> list[TargetRun]:
    """``run_target`` for each target in turn.  ``progress_for(target)`` may return a
    per-request callback and a closer (for progress bars)."""
    runs: list[TargetRun] = []
    for target in targets:
        progress, close = progress_for(target) if progress_for else (None, lambda: None)
        try:
            runs.append(await run_target(fleet, target, trace, base, progress))
        finally:
            close()
    return runs


SWEEP_AXES: tuple[str, ...] = ("replicas", "num_blocks", "think")
"""What ``--sweep`` may vary: replica count, KV blocks per replica, and a factor on
every think time (longer thinking, more traffic between turns, more evictions)."""


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[float]]]:
    """``["replicas=2,4,8"]`` -> ``[("replicas", [2.0, 4.0, 8.0])]``."""
    out: list[tuple[str, list[float]]] = []
    for item in items:
        axis, sep, values = item.partition("=")
        if not sep or axis not in SWEEP_AXES:
            raise ValueError(f"bad --sweep {item!r}: use one of {', '.join(SWEEP_AXES)}=V1,V2")
        out.append((axis, [float(v) for v in values.split(",") if v.strip()]))
    return out


def scale_think(trace: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The trace with every think time multiplied by ``factor``."""
    return [replace(r, think_s=r.think_s * factor) for r in trace]


def reexec_in_netns(env_name: str, argv: Sequence[str], module: str = "kvroute") -> int:
    """Run ``python -m <module> <argv>`` again inside a new loopback-only network
    namespace and delete the namespace afterwards (peer routers must not reach the
    network)."""
    import os
    import subprocess
    import sys

    name = f"kvbench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True)
        proc = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-m", module, *argv],
            env={**os.environ, env_name: name}, check=False,
        )
        return proc.returncode
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


async def run_compare(
    args: Any,
    peers: Sequence[PeerSpec],
    workload_spec: Callable[[Any, float | None], Any],
    say: Callable[[str], None] = print,
) -> str:
    """``kvroute bench compare``: every target on the fleet, for every sweep point.

    Writes ``compare.json`` (and plots) to ``args.out``; returns the text to print."""
    import json
    from pathlib import Path

    from aio.clock_warp import ClockWarp
    from bench import plots, report
    from bench.fleet import FleetSpec, build_tokenizer_dir
    from bench.trace import load, save
    from bench.workload import generate, measure_tokens_per_word

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.tokenizer or await build_tokenizer_dir(out / "tiny-model")
    tpw = await asyncio.to_thread(measure_tokens_per_word, tok_dir)
    base_trace = load(args.trace) if args.trace else generate(workload_spec(args, tpw))
    save(base_trace, out / "trace.jsonl")
    policies = [p for p in args.policies.split(",") if p]
    targets = [Target(p, policy=p) for p in policies] + [Target(p.name, peer=p) for p in peers]
    scale = args.time_scale or 0.1
    repeats = max(1, getattr(args, "repeats", 1))
    if scale != 1.0 and peers:
        say(f"note: time scale {scale:g}: kvroute's routers judge time in the replicas' "
            "time (RouterSettings.time_scale), the peer routers in wall time (their "
            f"windows are stretched {1 / scale:g}x); pass --time-scale 1 for figures where "
            "no router's clock differs from the replicas'")
    # Idle time is skipped (bench.idle_skip): the replicas, kvroute's routers and the
    # runner read one clock offset, moved forward whenever nothing is in flight.
    clock_file = None
    if not getattr(args, "no_skip_idle", False):
        clock_file = (out / "clock-warp").resolve()
        ClockWarp.create(clock_file).close()
    run_cfg = RunConfig(url="", model="kvroute-bench", time_scale=scale, replies=args.replies,
                        stream=not args.no_stream, max_tokens_cap=args.max_tokens,
                        sim_timing=True, clock_file=clock_file)
    sweeps = parse_sweep(args.sweep) or [("none", [0.0])]
    lines: list[str] = []  # every request of every run, for results.jsonl
    texts: list[str] = []
    points: list[dict[str, Any]] = []
    for axis, values in sweeps:
        for value in values:
            replicas = int(value) if axis == "replicas" else args.replicas
            num_blocks = int(value) if axis == "num_blocks" else args.num_blocks
            trace = scale_think(base_trace, value) if axis == "think" else base_trace
            label = "" if axis == "none" else f"{axis}={value:g}"
            workers = getattr(args, "router_workers", 1)
            say(f"{label or 'run'}: {len(trace)} requests, {replicas} replicas x "
                f"{num_blocks} blocks, targets {', '.join(t.name for t in targets)}"
                + (f" (kvroute with {workers} workers)" if workers > 1 else ""))
            spec = FleetSpec(tokenizer=tok_dir, replicas=replicas, model=run_cfg.model,
                             block_size=args.block_size, num_blocks=num_blocks,
                             time_scale=scale, profile=args.profile, router=False,
                             log_dir=out / "logs", clock_file=clock_file,
                             router_workers=workers)
            prompts: dict[tuple[str, int], CacheRequest] = {}
            rounds = []
            for _ in range(repeats):  # targets interleaved round by round
                # A fresh fleet each round: new addresses, so every consistent-hash ring
                # (session affinity, the peers' consistent_hash, kv's tie order) assigns
                # the sessions anew, and a ring's median is over that many assignments
                # rather than one lucky or unlucky draw repeated.
                async with Fleet(spec) as fleet:
                    if not prompts:
                        prompts = await tokenize_trace(fleet.replica_urls[0], trace,
                                                       model=spec.model,
                                                       max_tokens_cap=args.max_tokens)
                    rounds.append(await run_targets(
                        fleet, targets, trace, run_cfg,
                        progress_bars(not args.no_progress, len(trace))))
            capacity = replicas * (num_blocks - 1)
            summaries = [[await run_summary(r, prompts, block_size=args.block_size,
                                         capacity=capacity, model=spec.model,
                                         time_scale=scale)
                          for r in runs if r.error is None] for runs in rounds]
            skipped = [f"skipped {r.target.name}: {r.error}" for runs in rounds for r in runs
                       if r.error]
            table = (report.format_table(summaries[0]) if repeats == 1
                     else report.format_repeats(summaries))
            texts.append("\n".join(filter(None, [label, table, *skipped])))
            for i, round_summaries in enumerate(summaries):
                for s in round_summaries:
                    points.append({"axis": axis, "value": value, "policy": s.name,
                                   "repeat": i, "cached_share": s.cached_share,
                                   "ttft_p50_ms": (s.ttft_p50 or 0) * 1000,
                                   "ttft_p99_ms": (s.ttft_p99 or 0) * 1000,
                                   **s.to_json(),
                                   "bounds": s.bounds.shares() if s.bounds else None})
            for i, round_runs in enumerate(rounds):
                for r in round_runs:
                    lines.extend(
                        json.dumps({"axis": axis, "value": value, "target": r.target.name,
                                    "repeat": i, **res.to_json()}) + "\n"
                        for res in r.results)
            runs = rounds[-1]
            if axis == "none":
                by_name = {r.target.name: r.results for r in runs if r.error is None}
                plots.ttft_distribution(by_name, out / "ttft-distribution.png",
                                        time_scale=scale)
                plots.ttft_by_turn_plot(by_name, out / "ttft-by-turn.png", time_scale=scale)
    for axis, _ in sweeps:
        if axis == "none":
            continue
        pts = _medians([{**p, axis: p["value"]} for p in points if p["axis"] == axis])
        plots.sweep_plot(pts, out / f"sweep-{axis}-cached.png", x=axis, y="cached_share",
                         title=f"cached share vs {axis}")
        plots.sweep_plot(pts, out / f"sweep-{axis}-p99.png", x=axis, y="ttft_p99_ms",
                         title=f"TTFT p99 (ms) vs {axis}")
    (out / "results.jsonl").write_text("".join(lines))
    (out / "compare.json").write_text(json.dumps({"points": points}, indent=2) + "\n")
    texts.append(f"written: {out / 'compare.json'}, {out / 'results.jsonl'}")
    return "\n\n".join(texts)


def _medians(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (policy, sweep value): the median of its repeats' figures."""
    import statistics

    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["policy"], p["value"]), []).append(p)
    return [{**runs[0], **{k: statistics.median(r[k] for r in runs)
                           for k in ("cached_share", "ttft_p99_ms", "ttft_p50_ms")}}
            for runs in groups.values()]


def progress_bars(
    enabled: bool, total: int
) -> Callable[[Target], tuple[ProgressFn | None, Callable[[], None]]]:
    """A ``progress_for`` for ``run_targets``: one tqdm bar per target (or none)."""

    def make(target: Target) -> tuple[ProgressFn | None, Callable[[], None]]:
        if not enabled:
            return None, lambda: None
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"{target.name:<13}", unit="req", mininterval=0.5)

        def step(_: RequestResult) -> None:
            bar.update(1)

        return step, bar.close

    return make
