"""``kvroute demo``: what KV-aware routing is worth, on a simulated fleet, in one command.

Steps (all children of this process, all stopped at the end, on errors and on Ctrl-C):

1. Build the tiny test tokenizer (``kvroute replica tiny-model``) in the output folder.
2. Generate a multi-turn workload in the main example's shape (a 1,500-token system
   prompt per tenant, 150-token user turns, 350-token replies, 10 turns, log-normal think
   time with a tail of late returners, Poisson arrivals), sized to the tokenizer.
3. Start a simulated fleet (``kvroute sim``, 4 replicas by default) at a time scale that
   replays minutes of traffic in seconds.
4. For each policy: empty the replicas' caches, start ``kvroute serve --policy P`` (the
   in-memory index, fed by the replicas' KV events), replay the trace open loop.
5. Compute the cache bounds from the replicas' own tokenisation of the trace, for each
   policy's run in the order it sent its requests (``bench.compare.run_summary``).
6. Print the table; write it to ``table.txt``, and ``summary.json``, ``results.jsonl``,
   ``trace.jsonl`` and the plots ``ttft-distribution.png`` and ``ttft-by-turn.png``, in
   the output folder.

Sized for two minutes on two cores, in simulated time: generation is capped
(``--max-tokens``, default 16) while the history grows by the trace's 350-token replies
(TTFT and prefill, the figures compared, do not depend on the number of generated
tokens); think times are short (median 2.5 s, 10% of users back after ~25 s) and arrivals
dense, which keeps the same competition for cache between turns as minutes of real
traffic would at a proportionally lower rate.  The time scale (0.1: ten times faster than
real time) is the compromise between run time and wall-clock noise: TTFT is the simulated
replica's own figure (simulated seconds), but a replica that falls behind the wall clock
on a busy machine adds its lag divided by the time scale.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import plots, report
from bench.bounds import Bounds
from bench.compare import (
    POLICIES,
    Target,
    TargetRun,
    progress_bars,
    run_summary,
    run_targets,
    tokenize_trace,
)
from bench.fleet import Fleet, FleetSpec, build_tokenizer_dir
from bench.runner import RunConfig
from bench.trace import TraceRequest, save
from bench.workload import Dist, ThinkTime, WorkloadSpec, measure_tokens_per_word, preset


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Everything the demo can be told (the CLI's flags)."""

    out: Path = Path("kvroute-demo-out")
    replicas: int = 4
    policies: tuple[str, ...] = POLICIES
    sessions: int = 16
    turns: int = 10
    system_tokens: int = 1500
    user_tokens: int = 150
    reply_tokens: int = 350
    tenants: int = 4
    arrival_rate: float = 0.6
    """New conversations per simulated second."""
    think_median_s: float = 2.5
    think_tail_share: float = 0.1
    think_tail_median_s: float = 25.0
    block_size: int = 16
    num_blocks: int = 2048
    """KV blocks per replica (about 32k tokens): enough for a few live conversations
    each, so spreading a conversation over every replica costs evictions."""
    time_scale: float = 0.1
    """Wall seconds per simulated second."""
    max_tokens: int = 16
    profile: str = "llama-3.1-8b-h100"
    seed: int = 0
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'}: "
                             f"--policies takes a comma-separated list from {', '.join(POLICIES)}")
        for name, least in (("replicas", 1), ("sessions", 1), ("turns", 1), ("num_blocks", 2),
                            ("max_tokens", 1), ("tenants", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, "
                                 f"got {getattr(self, name)}")
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be above 0, got {self.time_scale}")

    def workload(self, tpw: float) -> WorkloadSpec:
        """The workload for a tokenizer with ``tpw`` tokens per generated word."""
        return preset(
            "main",
            sessions=self.sessions,
            arrival_rate=self.arrival_rate,
            turns=Dist("fixed", self.turns),
            system_tokens=Dist("fixed", self.system_tokens),
            user_tokens=Dist("fixed", self.user_tokens),
            reply_tokens=Dist("fixed", self.reply_tokens),
            think=ThinkTime(
                Dist("lognormal", self.think_median_s, 0.6, hi=self.think_median_s * 10),
                Dist("lognormal", self.think_tail_median_s, 0.3,
                     hi=self.think_tail_median_s * 5),
                self.think_tail_share,
            ),
            tenants=self.tenants,
            sharing="tenant",
            tokens_per_word=tpw,
            seed=self.seed,
        )


@dataclass(slots=True)
class DemoResult:
    """What the demo produced."""

    table: str
    summaries: list[report.RunSummary]
    bounds: Bounds | None
    """The bounds of the run at the median pooled LRU share (``report.typical_bounds``);
    each summary has its own run's."""
    files: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


async def run_demo(opts: DemoOptions, say: Callable[[str], None] = print) -> DemoResult:
    """Run the demo (see the module docstring); returns the table and summaries."""
    t_start = time.perf_counter()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = await build_tokenizer_dir(out / "tiny-model")
    tpw = await asyncio.to_thread(measure_tokens_per_word, tok_dir)
    spec = opts.workload(tpw)
    from bench.workload import generate

    trace = generate(spec)
    save(trace, out / "trace.jsonl")
    say(f"workload: {len(trace)} requests, {opts.sessions} conversations x {opts.turns} "
        f"turns, {opts.tenants} tenants; fleet: {opts.replicas} simulated replicas x "
        f"{opts.num_blocks} blocks of {opts.block_size}; time scale {opts.time_scale}")
    fleet_spec = FleetSpec(
        tokenizer=tok_dir, replicas=opts.replicas, model="kvroute-demo",
        block_size=opts.block_size, num_blocks=opts.num_blocks, time_scale=opts.time_scale,
        profile=opts.profile, router=False, log_dir=out / "logs",
    )
    base = RunConfig(url="", model=fleet_spec.model, time_scale=opts.time_scale,
                     max_tokens_cap=opts.max_tokens, sim_timing=True)
    targets = [Target(p, policy=p) for p in opts.policies]
    async with Fleet(fleet_spec) as fleet:
        prompts = await tokenize_trace(fleet.replica_urls[0], trace, model=fleet_spec.model,
                                       max_tokens_cap=opts.max_tokens)
        runs = await run_targets(fleet, targets, trace, base,
                                 progress_bars(opts.progress, len(trace)))
    summaries = [await run_summary(r, prompts, block_size=opts.block_size,
                                   capacity=opts.replicas * (opts.num_blocks - 1),
                                   model=fleet_spec.model, time_scale=opts.time_scale)
                 for r in runs if r.error is None]
    return _finish(opts, trace, runs, summaries, tpw, t_start)


def _finish(
    opts: DemoOptions,
    trace: Sequence[TraceRequest],
    runs: Sequence[TargetRun],
    summaries: list[report.RunSummary],
    tpw: float,
    t_start: float,
) -> DemoResult:
    out = opts.out
    done = [r for r in runs if r.error is None]
    skipped = {r.target.name: r.error or "" for r in runs if r.error is not None}
    table = report.format_table(summaries)
    result = DemoResult(table, summaries, report.typical_bounds(summaries), skipped=skipped)
    (out / "table.txt").write_text(table + "\n")
    result.files["table"] = str(out / "table.txt")
    with (out / "results.jsonl").open("w") as fh:
        for r in done:
            for x in r.results:
                fh.write(json.dumps({"target": r.target.name, **x.to_json()}) + "\n")
    result.files["results"] = str(out / "results.jsonl")
    result.files["trace"] = str(out / "trace.jsonl")
    by_name = {r.target.name: r.results for r in done}
    if opts.plots and done:
        result.files["ttft_distribution"] = str(
            plots.ttft_distribution(by_name, out / "ttft-distribution.png",
                                    time_scale=opts.time_scale))
        result.files["ttft_by_turn"] = str(
            plots.ttft_by_turn_plot(by_name, out / "ttft-by-turn.png",
                                    time_scale=opts.time_scale))
    result.wall_s = round(time.perf_counter() - t_start, 1)
    doc = report.to_json(summaries, result.bounds, {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "tokens_per_word": tpw,
        "requests": len(trace),
        "skipped": skipped,
        "ttft_by_turn_ms": {
            r.target.name: {t: round(v * 1000, 2) for t, v in
                            report.ttft_by_turn(r.results, opts.time_scale).items()}
            for r in done
        },
        "wall_s": result.wall_s,
    })
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    result.files["summary"] = str(out / "summary.json")
    return result


def render_result(result: DemoResult) -> str:
    """The text the CLI prints at the end."""
    lines = ["", result.table, ""]
    for name, why in result.skipped.items():
        lines.append(f"skipped {name}: {why}")
    if result.bounds is not None and result.bounds.prompt_tokens:
        b = result.bounds.shares()
        lines.append(
            f"bounds: one cache of the fleet's size serves {b['pooled_lru']:.0%} of prompt "
            f"tokens from cache with LRU, at most {b['pooled_optimal']:.0%} with optimal "
            f"replacement; an infinite cache {b['unbounded']:.0%}")
    for key, path in result.files.items():
        lines.append(f"{key}: {path}")
    lines.append(f"done in {result.wall_s:.0f} s")
    return "\n".join(lines)


def options_json(opts: DemoOptions) -> dict[str, Any]:
    """The options as JSON (for logs)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()}
