"""Subcommands of ``kvroute`` that belong to ``bench``.

* ``kvroute demo``: a simulated fleet, every policy in turn, the table and plots.
* ``kvroute bench generate|run|compare``: workloads, replay against any endpoint, and
  policy (and peer router) comparisons on a simulated fleet, with sweeps.
* ``kvroute check-prompts``: the append-only prompt checker (``bench.check_prompts_cli``).
* ``kvroute probe-horizon``: the turn-2 eviction-horizon probe (``bench.horizon_cli``).

Handlers import their heavy dependencies lazily so ``kvroute --help`` stays fast.  Every
handler runs its event loop with ``asyncio.run``, so Ctrl-C cancels the main task and the
fleet's ``async with`` stops every child process on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import check_prompts_cli, horizon_cli
from bench.asyncio_main import run_main as _run

NETNS_ENV = "KVROUTE_BENCH_NETNS"
"""Set (to the namespace's name) when ``kvroute bench compare`` runs inside the
loopback-only network namespace it created for peer routers."""


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this layer's subcommands to the ``kvroute`` parser."""
    _register_demo(sub)
    _register_bench(sub)
    check_prompts_cli.register(sub)
    horizon_cli.register(sub)


# ---- demo ----------------------------------------------------------------------------


def _register_demo(sub: argparse._SubParsersAction[Any]) -> None:
    from bench.compare import POLICIES

    p = sub.add_parser(
        "demo",
        help="show what KV-aware routing saves, on a simulated fleet (no GPU needed)",
        description="Start a simulated fleet and kvroute, drive a multi-turn workload with "
        "think time through each routing policy in turn, and print prefill computed, "
        "cached share (and its share of the cache bounds), TTFT p50/p90/p99, same-replica "
        "share; writes the table (table.txt), summary.json, results.jsonl and PNG plots to "
        "--out.",
    )
    p.add_argument("--out", type=Path, default=Path("kvroute-demo-out"),
                   help="output folder (default ./kvroute-demo-out)")
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--sessions", type=int, default=None, help="conversations (default 16)")
    p.add_argument("--turns", type=int, default=None, help="turns each (default 10)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default 2048)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="wall seconds per simulated second (default 0.1)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="generated tokens per turn (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from bench.demo import DemoOptions, render_result, run_demo
    from bench.fleet import FleetError

    changes = {name: getattr(args, name) for name in
               ("sessions", "turns", "num_blocks", "time_scale", "max_tokens")
               if getattr(args, name) is not None}
    try:
        opts = replace(DemoOptions(), out=args.out, replicas=args.replicas,
                       policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                       seed=args.seed, progress=not args.no_progress, plots=not args.no_plots,
                       **changes)
    except ValueError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    try:
        result = _run(run_demo(opts, say=_say))
    except FleetError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvroute demo: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    if args.json:
        print(Path(result.files["summary"]).read_text())
    else:
        print(render_result(result))
    return 0 if result.summaries else 1


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- bench ---------------------------------------------------------------------------


def _register_bench(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "bench",
        help="workloads, trace replay and policy comparisons",
        description="Generate multi-turn workloads, replay them against any "
        "OpenAI-compatible endpoint, or compare routing policies (and peer routers) on a "
        "simulated fleet.",
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)

    g = bsub.add_parser("generate", help="write a workload trace (JSONL)",
                        description="Write a multi-turn workload trace (JSONL, one turn a "
                        "line) and print its summary.")
    _workload_args(g)
    g.add_argument("--out", type=Path, required=True, help="trace file to write")
    g.set_defaults(func=_bench_generate)

    i = bsub.add_parser(
        "import-trace",
        help="convert a block-hash trace (aiperf / Dynamo / Mooncake JSONL) to a chat trace",
        description="Each hash id becomes --block-tokens words (equal ids, equal words); "
        "lengths scale by block-tokens / 512 and time by --time-compression (default the "
        "same factor: prompt tokens per second preserved).  See bench/hashtrace.py.",
    )
    i.add_argument("hash_trace", type=Path, help="the block-hash JSONL file")
    i.add_argument("--out", type=Path, required=True, help="chat trace (JSONL) to write")
    i.add_argument("--block-tokens", type=int, default=64,
                   help="tokens each hash id becomes (a multiple of the replicas' block size)")
    i.add_argument("--source-block-tokens", type=int, default=512,
                   help="tokens per hash id in the source trace")
    i.add_argument("--time-compression", type=float, default=None,
                   help="divide the trace's times by this (default: source-block-tokens / "
                   "block-tokens, which keeps prompt tokens per second)")
    i.add_argument("--start-s", type=float, default=0.0, help="window start (trace seconds)")
    i.add_argument("--duration-s", type=float, default=None, help="window length")
    i.add_argument("--tokenizer", type=Path, default=None,
                   help="write words this tokenizer encodes as one token each (exact "
                   "lengths; default: common English words, about one token each)")
    i.set_defaults(func=_bench_import)

    r = bsub.add_parser("run", help="replay a trace against an OpenAI-compatible URL",
                        description="Replay a trace (or a generated workload) open-loop "
                        "against any OpenAI-compatible endpoint and print the summary table.")
    r.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    r.add_argument("--model", required=True, help="model for trace lines that name none")
    _workload_args(r)
    _replay_args(r)
    r.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                   help="extra request header (repeatable), e.g. X-KVRoute-Policy:kv")
    r.add_argument("--out", type=Path, default=None, help="results JSONL to write")
    r.set_defaults(func=_bench_run)

    c = bsub.add_parser(
        "compare",
        help="compare policies (and peer routers) on a simulated fleet, with the cache bounds",
        description="Each target gets the same trace on the same simulated fleet with "
        "emptied caches.  Peer routers (--peer) run only inside a loopback-only network "
        "namespace (this command re-executes itself inside one; needs root and `ip`).",
    )
    _workload_args(c)
    _replay_args(c)
    _fleet_args(c)
    c.add_argument("--policies", default="round_robin,least_loaded,session,kv",
                   help="comma-separated router policies to compare")
    c.add_argument("--peer", action="append", default=[], metavar="SPEC",
                   help="name=NAME;cmd=COMMAND with {port} and {workers};ready=/health "
                   "(repeatable)")
    c.add_argument("--peers", choices=("none", "standard"), default="none",
                   help="standard: sglang-router cache_aware, vllm-router cache_aware and "
                   "consistent_hash, from PATH or --peer-bin (bench/overhead_peers.py)")
    c.add_argument("--peer-bin", type=Path, default=None,
                   help="folder holding the peers' binaries (smg, vllm-router)")
    c.add_argument("--repeats", type=int, default=1,
                   help="runs of every target at every sweep point, interleaved round by "
                   "round; the table gives medians with the spread [min-max]")
    c.add_argument("--sweep", action="append", default=[], metavar="AXIS=V1,V2",
                   help="vary replicas, num_blocks or think (a factor on think times); "
                   "repeatable, one axis at a time")
    c.add_argument("--out", type=Path, default=Path("kvroute-bench-out"),
                   help="output folder (summary JSON, results, plots)")
    c.add_argument("--no-skip-idle", action="store_true",
                   help="wait out the fleet's idle time instead of skipping it (by default "
                   "the replicas', kvroute routers' and the runner's clocks move forward "
                   "together whenever nothing is in flight: bench/idle_skip.py)")
    c.add_argument("--router-workers", type=int, default=1, metavar="N",
                   help="run each kvroute target as `kvroute serve --workers N` (N processes "
                   "on one port, each with its own index, load and session state)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=_bench_compare)

    from bench import soak

    soak.register(bsub)
    bsub.choices["soak"].set_defaults(func=_bench_soak)


def _workload_args(p: argparse.ArgumentParser) -> None:
    from bench.workload import PRESETS

    w = p.add_argument_group("workload (ignored with --trace)")
    w.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace")
    w.add_argument("--preset", choices=PRESETS, default="main",
                   help="main: 1,500-token system prompt per tenant, 150-token questions, "
                   "350-token replies, 10 turns; small: scaled down; shared: one system "
                   "prompt for all; unique: one per user")
    w.add_argument("--sessions", type=int, default=None,
                   help="conversations (default: the preset's)")
    w.add_argument("--arrival-rate", type=float, default=None,
                   help="new conversations per second (Poisson)")
    w.add_argument("--turns", default=None, help="distribution, e.g. 10 or uniform:4,12")
    w.add_argument("--system-tokens", default=None, help="e.g. 1500 or lognormal:1500,0.3")
    w.add_argument("--user-tokens", default=None,
                   help="user message length distribution (default: the preset's)")
    w.add_argument("--reply-tokens", default=None,
                   help="reply length distribution (default: the preset's)")
    w.add_argument("--sharing", choices=("shared", "tenant", "unique"), default=None,
                   help="who shares a system prompt (default: the preset's, tenant)")
    w.add_argument("--tenants", type=int, default=None,
                   help="tenants (system prompts) with --sharing tenant (default: the preset's)")
    w.add_argument("--salted", action="store_true", help="a cache_salt per tenant")
    w.add_argument("--think-median", type=float, default=None, help="seconds")
    w.add_argument("--think-sigma", type=float, default=None,
                   help="log-normal sigma of think times (default: the preset's)")
    w.add_argument("--think-tail-share", type=float, default=None,
                   help="share of long pauses (default: the preset's)")
    w.add_argument("--think-tail-median", type=float, default=None, help="seconds")
    w.add_argument("--tokens-per-word", type=float, default=None,
                   help="converts token lengths to words (default: measured on the "
                   "tokenizer where there is one, else 1.0)")
    w.add_argument("--seed", type=int, default=0, help="seeds the workload")


def _replay_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("replay")
    r.add_argument("--time-scale", type=float, default=None,
                   help="wall seconds per trace second (default 1, compare: 0.1)")
    r.add_argument("--replies", choices=("trace", "actual"), default="trace",
                   help="history carries the trace's fixed replies (default) or the real ones")
    r.add_argument("--max-tokens", type=int, default=None, help="cap generated tokens per turn")
    r.add_argument("--no-stream", action="store_true", help="send non-streaming requests")
    r.add_argument("--sim-timing", action="store_true",
                   help="ask simulated replicas for simulated TTFT")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("simulated fleet")
    f.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    f.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    f.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per replica")
    f.add_argument("--profile", default="llama-3.1-8b-h100",
                   help="the simulated replicas' timing profile")
    f.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory (default: build the tiny one in --out)")


def _workload_spec(args: argparse.Namespace, tpw: float | None = None) -> Any:
    from dataclasses import replace

    from bench.workload import Dist, ThinkTime, preset

    spec = preset(args.preset, seed=args.seed)
    changes: dict[str, Any] = {}
    for name in ("sessions", "arrival_rate", "sharing", "tenants", "tokens_per_word"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    for name in ("turns", "system_tokens", "user_tokens", "reply_tokens"):
        if getattr(args, name) is not None:
            changes[name] = Dist.parse(getattr(args, name))
    if args.salted:
        changes["salted"] = True
    if tpw is not None and args.tokens_per_word is None:
        changes["tokens_per_word"] = tpw
    think = spec.think
    body, tail = think.body, think.tail
    if args.think_median is not None:
        body = replace(body, a=args.think_median, hi=max(body.hi, args.think_median * 10))
    if args.think_sigma is not None:
        body = replace(body, b=args.think_sigma)
    if args.think_tail_median is not None:
        tail = replace(tail, a=args.think_tail_median,
                       hi=max(tail.hi, args.think_tail_median * 5))
    share = think.tail_share if args.think_tail_share is None else args.think_tail_share
    changes["think"] = ThinkTime(body, tail, share)
    return replace(spec, **changes)


def _load_or_generate(args: argparse.Namespace, tpw: float | None = None) -> list[Any]:
    from bench.trace import load
    from bench.workload import generate

    if args.trace is not None:
        return load(args.trace)
    return generate(_workload_spec(args, tpw))


def _bench_generate(args: argparse.Namespace) -> int:
    from bench.trace import save
    from bench.workload import summarize

    trace = _load_or_generate(args)
    save(trace, args.out)
    print(json.dumps({"trace": str(args.out), **summarize(trace)}, indent=2))
    return 0


def _bench_import(args: argparse.Namespace) -> int:
    from bench.hashtrace import (
        HashScale,
        import_records,
        load_hash_trace,
        single_token_words,
        to_trace,
    )
    from bench.trace import save
    from bench.workload import WORDS, summarize

    scale = HashScale(block_tokens=args.block_tokens,
                      source_block_tokens=args.source_block_tokens,
                      time_compression=args.time_compression, start_s=args.start_s,
                      duration_s=args.duration_s)
    words = single_token_words(args.tokenizer) if args.tokenizer else list(WORDS)
    trace = to_trace(import_records(load_hash_trace(args.hash_trace), scale), scale, words)
    save(trace, args.out)
    print(json.dumps({"trace": str(args.out), "time_compression": scale.compression,
                      **summarize(trace)}, indent=2))
    return 0


def _headers(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise SystemExit(f"bad --header {item!r}: expected NAME:VALUE")
        out[name.strip()] = value.strip()
    return out


def _bench_run(args: argparse.Namespace) -> int:
    from bench import report
    from bench.runner import RunConfig, Runner

    trace = _load_or_generate(args)
    cfg = RunConfig(
        url=args.url, model=args.model, time_scale=args.time_scale or 1.0,
        replies=args.replies, stream=not args.no_stream, headers=_headers(args.header),
        max_tokens_cap=args.max_tokens, sim_timing=args.sim_timing,
    )

    async def go() -> list[Any]:
        async with Runner(cfg) as runner:
            return await runner.run(trace)

    try:
        results = _run(go())
    except KeyboardInterrupt:
        print("kvroute bench run: interrupted", file=sys.stderr)
        return 130
    if args.out is not None:
        with args.out.open("w") as fh:
            for r in results:
                fh.write(json.dumps(r.to_json()) + "\n")
    summary = report.summarize(args.url, results, time_scale=cfg.time_scale)
    print(report.format_table([summary]))
    return 0 if summary.errors == 0 else 1


def _bench_compare(args: argparse.Namespace) -> int:
    from bench.compare import PeerSpec, reexec_in_netns, run_compare

    peers = [PeerSpec.parse(s) for s in args.peer]
    if args.peers == "standard":
        from bench.overhead_peers import standard_peers

        peers = standard_peers(args.peer_bin) + peers
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.router_workers < 1:
        raise SystemExit("--router-workers must be at least 1")
    if peers and not os.environ.get(NETNS_ENV):
        return reexec_in_netns(NETNS_ENV, sys.argv[1:])
    try:
        doc = _run(run_compare(args, peers, _workload_spec, say=_say))
    except KeyboardInterrupt:
        print("kvroute bench: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    print(doc)
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from bench.soak import main, passed

    try:
        report = _run(main(args, say=_say))
    except KeyboardInterrupt:
        print("kvroute bench soak: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    print(report.to_json())
    return 0 if passed(report) else 1
