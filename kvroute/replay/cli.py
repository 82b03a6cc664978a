"""``kvroute replay``: the virtual-time replay from the command line.

Replays one workload through each policy on fleets of each pool size and prints one
Markdown table per pool size (cached share, share of each cache bound, simulated TTFT
p50/p99, moved later turns, exact predictions, the fleet's copies of blocks and the
pooled LRU figure less them: ``kvroute.replay.summary``), plus a JSON file with
``--out``.

With ``--namings K`` every policy runs under K namings of the replicas (the same
fleet, other names, so consistent-hash rings assign sessions differently) and the table
gives each policy's median and range, and how often it cached more than the first
policy under the same naming: session affinity's figure moves a point or two with the
assignment alone, so one naming cannot tell a better policy from a luckier ring.

With ``--seeds A-B`` the generated workload is drawn once per seed and every seed runs
every policy under every naming (``--jobs`` processes side by side): one table per pool
size with each policy's mean over the seeds and, seed by seed against the first policy,
how often it cached more and the mean difference with a 95% interval
(``kvroute.replay.seeds``): a difference of a fraction of a point needs many seeds to
be told from the draw.  With ``--hash-trace`` and ``--duration-s`` the seeds are
consecutive windows of the trace (seed ``k`` from ``--start-s`` + ``k`` x
``--duration-s``).

A policy may carry changed scoring settings, ``kv/price_future=false``: it runs beside
the others under that label (``kvroute.replay.policy_spec``), so what one term of the
policy is worth is measured on the same workload and namings.

Workloads: the 64-conversation chat workload of ``kvroute bench compare`` (``--sessions``,
``--seed``; rendered with the tiny tokenizer's chat template), a chat trace
(``--trace``), or a block-hash trace (``--hash-trace``: aiperf / Mooncake JSONL, scaled
by ``--block-tokens``, ``--time-compression``, ``--start-s``, ``--duration-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.replay.policy_spec import PolicySpec
    from kvroute.replay.seeds import SeedPlan

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``replay`` to the ``kvroute`` command line."""
    p = sub.add_parser(
        "replay",
        help="deterministic virtual-time replay of the real policies on simulated pools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", type=Path, default=None, help="chat trace (bench generate)")
    w.add_argument("--hash-trace", type=Path, default=None,
                   help="block-hash JSONL (aiperf / Dynamo / Mooncake)")
    w.add_argument("--sessions", type=int, default=64,
                   help="conversations of the generated workload (without --trace)")
    w.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    w.add_argument("--seeds", default=None, metavar="SEEDS",
                   help="several seeds of the generated workload (0-23, or 1,4,9), or "
                        "with --hash-trace several windows of --duration-s each (seed k "
                        "starts at --start-s + k * --duration-s): policies compared over "
                        "them, paired seed by seed")
    w.add_argument("--block-tokens", type=int, default=64, help="tokens per hash id")
    w.add_argument("--time-compression", type=float, default=None,
                   help="hash trace: divide its times by this (default: 512 / block-tokens)")
    w.add_argument("--start-s", type=float, default=0.0,
                   help="hash trace: window start, in trace seconds")
    w.add_argument("--duration-s", type=float, default=None,
                   help="hash trace: window length, in trace seconds (default: all)")
    w.add_argument("--max-tokens", type=int, default=None, help="cap generated tokens")
    f = p.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    f.add_argument("--num-blocks", default="600,1024,2048",
                   help="KV blocks per replica, comma-separated (one table each)")
    f.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    f.add_argument("--profile", default="llama-3.1-8b-h100",
                   help="timing profile of the simulated engine")
    f.add_argument("--routers", type=int, default=1,
                   help="router processes, each with its own policy state, every request "
                        "dealt to one at random (kvroute serve --workers N; "
                        "kvroute.replay.loop)")
    f.add_argument("--no-shared-outlook", action="store_true",
                   help="with --routers N: the routers share only the index and the "
                        "scrapes (kvroute serve on one Redis index with "
                        "index.share_outlook: false), not the kv look ahead's news "
                        "(router.outlook_peers)")
    p.add_argument("--policies", default="round_robin,least_loaded,session,kv",
                   help="comma-separated policies to replay; each may change scoring "
                        "settings, kv/pool_headroom=false/future_weight=0.5 "
                        "(kvroute.replay.policy_spec)")
    p.add_argument("--namings", type=int, default=1,
                   help="replay each policy under this many namings of the replicas "
                        "(hash assignments) and report medians and ranges")
    p.add_argument("--breakdown", metavar="BASELINE", default=None,
                   help="also compare every other policy with BASELINE turn by turn "
                        "(stay/move and reason, under the first naming; "
                        "kvroute.replay.breakdown)")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --seeds: replay this many seeds at once, one process each")
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure")
    p.set_defaults(func=_main)


def _requests(args: argparse.Namespace, model: str) -> list[Any]:
    from kvroute.replay.requests import from_chat_trace, load_hash_requests

    if args.hash_trace is not None:
        from bench.hashtrace import HashScale
        from kvroute.replay.loop import ReplayConfig

        scale = HashScale(block_tokens=args.block_tokens,
                          time_compression=args.time_compression,
                          start_s=args.start_s, duration_s=args.duration_s)
        return load_hash_requests(args.hash_trace, scale, ReplayConfig().vocab_size,
                                  max_tokens_cap=args.max_tokens)
    if args.trace is None:
        from kvroute.replay.seeds import workload

        return workload(args.seed, _plan(args), model)
    from bench.trace import load
    from replica.vllm.tiny_tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="kvroute-replay-") as tmp:
        tok = build_tokenizer(Path(tmp), template="llama3")
        return from_chat_trace(load(args.trace), tok, model=model,
                               max_tokens_cap=args.max_tokens)


def _specs(args: argparse.Namespace) -> list[PolicySpec]:
    from kvroute.replay.policy_spec import parse_policy

    specs = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
    if not specs:
        raise ValueError("no policies given")
    labels = [spec.label for spec in specs]
    if len(set(labels)) < len(labels):
        raise ValueError(f"a policy is given twice: {args.policies}")
    return specs


def _plan(args: argparse.Namespace) -> SeedPlan:
    from kvroute.replay.seeds import SeedPlan, TraceWindows

    windows = None
    if args.hash_trace is not None and args.seeds is not None:
        if args.duration_s is None:
            raise ValueError("with --hash-trace, a seed is a window of the trace: "
                             "give its length with --duration-s")
        windows = TraceWindows(args.hash_trace, args.duration_s, start_s=args.start_s,
                               block_tokens=args.block_tokens,
                               time_compression=args.time_compression)
    return SeedPlan(
        policies=tuple(spec.label for spec in _specs(args)),
        num_blocks=tuple(int(v) for v in args.num_blocks.split(",") if v.strip()),
        namings=max(1, args.namings), sessions=args.sessions, max_tokens=args.max_tokens,
        replicas=args.replicas, block_size=args.block_size, profile=args.profile,
        routers=args.routers, shared_outlook=not args.no_shared_outlook, windows=windows,
    )


def _seeds(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    from kvroute.replay.seeds import format_seeds, parse_seeds, run_seeds

    seeds = parse_seeds(args.seeds)
    plan = _plan(args)
    if plan.windows is not None:
        plan.windows.check(seeds)
    points = run_seeds(seeds, plan, jobs=args.jobs)
    tables = [format_seeds(points, nb, plan.policies) for nb in plan.num_blocks]
    return "\n\n".join(tables), [
        {"seed": p.seed, "num_blocks": p.num_blocks, "naming": p.naming,
         **p.figures.to_json(), "pooled_lru": p.pooled_lru,
         "lru_less_copies": p.lru_less_copies} for p in points]


async def _sweep(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    from kvroute.replay.breakdown import breakdown, format_breakdown
    from kvroute.replay.loop import ReplayConfig, Served, replay_run
    from kvroute.replay.summary import (
        RunFigures,
        bounds_of,
        copies_of,
        figures,
        format_namings,
        format_table,
    )

    base = ReplayConfig(replicas=args.replicas, block_size=args.block_size,
                        profile=args.profile)
    requests = _requests(args, base.model)
    specs = _specs(args)
    policies = [spec.label for spec in specs]
    tables: list[str] = []
    points: list[dict[str, Any]] = []
    for nb in (int(v) for v in args.num_blocks.split(",") if v.strip()):
        by_naming: dict[str, list[RunFigures]] = {p: [] for p in policies}
        bounds = None
        by_policy: dict[str, list[Served]] = {}
        for naming in range(max(1, args.namings)):
            cfg = ReplayConfig(replicas=base.replicas, num_blocks=nb,
                               block_size=base.block_size, profile=base.profile,
                               naming=naming, routers=args.routers,
                               shared_outlook=not args.no_shared_outlook)
            for spec in specs:
                policy = spec.label
                run = await replay_run(spec.name, requests, spec.config(cfg))
                served = run.served
                if naming == 0:
                    by_policy[policy] = served
                # Each run against the bounds of the order its own requests arrived in
                # (later turns wait for earlier replies, so the order depends on the
                # policy).
                own = bounds_of(served, requests, cfg)
                by_naming[policy].append(figures(policy, served, own,
                                                 copies_of(run, requests, cfg)))
                points.append({"num_blocks": nb, "naming": naming,
                               **by_naming[policy][-1].to_json(), "bounds": own.shares()})
                bounds = bounds or own
        if args.namings > 1:
            tables.append(format_namings(str(nb), by_naming, bounds))
        else:
            tables.append(format_table(str(nb), [r[0] for r in by_naming.values()], bounds))
        baseline = by_policy.get(args.breakdown) if args.breakdown else None
        for policy, served in by_policy.items():
            if baseline is None or policy == args.breakdown:
                continue
            rows = breakdown(served, baseline)
            total = sum(s.prompt_tokens for s in baseline if s.ok)
            tables.append(format_breakdown(policy, args.breakdown, rows, total))
            points.append({"num_blocks": nb, "policy": policy, "against": args.breakdown,
                           "breakdown": [r.to_json() for r in rows]})
    return "\n\n".join(tables), points


def _main(args: argparse.Namespace) -> int:
    try:
        _specs(args)
    except ValueError as exc:
        print(f"kvroute replay: --policies: {exc}", file=sys.stderr)
        return 2
    if args.routers < 1:
        print("kvroute replay: --routers must be at least 1", file=sys.stderr)
        return 2
    if args.seeds is not None:
        if args.trace is not None or args.breakdown:
            print("kvroute replay: --seeds draws the generated workload or windows of a "
                  "--hash-trace; it takes no --trace or --breakdown", file=sys.stderr)
            return 2
        if args.jobs < 1:
            print("kvroute replay: --jobs must be at least 1", file=sys.stderr)
            return 2
        try:
            text, points = _seeds(args)
        except (ValueError, OSError) as exc:
            print(f"kvroute replay: --seeds: {exc}", file=sys.stderr)
            return 2
    else:
        text, points = asyncio.run(_sweep(args))
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps({"points": points}, indent=2) + "\n")
    sys.stdout.flush()
    return 0
