"""Policies compared over many draws of the workload: ``kvroute replay --seeds``.

One seed of the generated chat workload is one draw of its conversations (their
lengths, think times and arrival times).  A fleet of LRU pools is chaotic in it: one
decision taken differently early on changes which blocks every later turn finds, so two
policies' cached shares on one seed differ by a point or two either way from the draw
alone (and a consistent-hash ring's, by its assignment of the sessions: the namings of
``--namings``).  A difference smaller than that cannot be read off one seed, through
HTTP or in the replay.

So every seed is replayed under every naming; a policy's figure on a seed is its median
over the namings, and each policy is compared with the first one seed by seed (paired:
the same conversations on both sides).  The table gives the mean over the seeds, the
seeds on which the policy cached more than the first, and the mean difference with a
95% interval (a percentile bootstrap over the seeds, its random draws seeded: the same
figures give the same interval).

A block-hash trace (aiperf, Mooncake) has no seed: its draws are its windows.  With
``TraceWindows``, seed ``k`` is the trace from ``start_s + k * duration_s`` for
``duration_s`` trace seconds (each window imported as ``kvroute replay --hash-trace
--start-s --duration-s`` imports it: a conversation that began before its window starts
there cold), so the seeds are consecutive, non-overlapping stretches of the same
traffic and the table says whether a difference holds through the trace or only in
one stretch of it.

Seeds are independent, so ``jobs`` processes replay them side by side; each process
renders (or imports) its seeds' workload itself.  The figures do not depend on ``jobs``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import statistics
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.replay.loop import ReplayConfig, replay_run
from kvroute.replay.policy_spec import parse_policy
from kvroute.replay.requests import ReplayRequest, from_chat_trace, load_hash_requests
from kvroute.replay.summary import (
    RunFigures,
    copies_of,
    figures,
    markdown_table,
    percent,
    pooled_lru_share,
    signed_points,
)
from router.parent_watch import stop_with_parent

__all__ = ["SeedPlan", "SeedPoint", "TraceWindows", "format_seeds", "mean_interval",
           "parse_seeds", "replay_seed", "run_seeds", "workload"]

if TYPE_CHECKING:
    from bench.hashtrace import HashScale

BOOTSTRAP_DRAWS = 10_000
"""Resamples of the seeds behind the interval of a mean difference."""


def parse_seeds(spec: str) -> list[int]:
    """``"0-23"``, ``"1,4,9"`` or a mix (``"0-3,10"``): the seeds, in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"not a seed or a range of seeds: {part!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"not a range of non-negative seeds: {part!r}")
        seeds.extend(s for s in range(first, last + 1) if s not in seeds)
    if not seeds:
        raise ValueError("no seeds given")
    return seeds


@dataclass(frozen=True, slots=True)
class TraceWindows:
    """A block-hash trace whose windows are the seeds (module docstring)."""

    path: Path
    duration_s: float
    """Trace seconds per window."""
    start_s: float = 0.0
    """Where window 0 starts, in trace seconds."""
    block_tokens: int = 64
    """Tokens each hash id becomes (``bench.hashtrace.HashScale``)."""
    time_compression: float | None = None
    """Trace seconds per replayed second (``None``: ``HashScale``'s default)."""

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.start_s < 0:
            raise ValueError("trace windows need a duration above 0 and a start of at least 0")

    def scale(self, seed: int) -> HashScale:
        """How window ``seed`` is imported."""
        from bench.hashtrace import HashScale

        return HashScale(block_tokens=self.block_tokens,
                         time_compression=self.time_compression,
                         start_s=self.start_s + seed * self.duration_s,
                         duration_s=self.duration_s)

    def check(self, seeds: Sequence[int]) -> None:
        """Refuse seeds whose window starts after the trace's last request."""
        from bench.hashtrace import load_hash_trace

        records = load_hash_trace(self.path)
        if not records:
            raise ValueError(f"{self.path} holds no requests")
        end_s = max(r.timestamp_ms for r in records) / 1000.0
        late = [s for s in seeds if self.scale(s).start_s > end_s]
        if late:
            raise ValueError(
                f"window {late[0]} starts at {self.scale(late[0]).start_s:g} s, after the "
                f"trace's last request ({end_s:g} s): at most "
                f"{int((end_s - self.start_s) // self.duration_s) + 1} windows of "
                f"{self.duration_s:g} s from {self.start_s:g} s")


@dataclass(frozen=True, slots=True)
class SeedPlan:
    """What every seed runs: the workload's size and the fleets and policies."""

    policies: tuple[str, ...]
    """Policy specs (``kvroute.replay.policy_spec``): a name, or a name with overrides."""
    num_blocks: tuple[int, ...]
    namings: int = 1
    sessions: int = 64
    max_tokens: int | None = None
    replicas: int = 4
    block_size: int = 16
    profile: str = "llama-3.1-8b-h100"
    routers: int = 1
    """Router processes in front of each fleet (``ReplayConfig.routers``)."""
    shared_outlook: bool = True
    """``ReplayConfig.shared_outlook``."""
    windows: TraceWindows | None = None
    """A block-hash trace cut into windows, one per seed, instead of the generated
    workload."""


@dataclass(frozen=True, slots=True)
class SeedPoint:
    """One policy's run on one seed, pool size and naming."""

    seed: int
    num_blocks: int
    naming: int
    figures: RunFigures
    pooled_lru: float
    """The pooled LRU bound's cached share over this run's requests, in the order they
    arrived (``summary.pooled_lru_share``)."""
    lru_less_copies: float
    """The same with the fleet's capacity less the copies this run's pools held
    (``summary.copies_of``): for a policy that never moves a conversation, the copies
    of the prefixes every replica serving them must hold."""


def workload(seed: int, plan: SeedPlan, model: str) -> list[ReplayRequest]:
    """The generated chat workload of ``seed`` (``kvroute bench compare``'s), rendered
    with the tiny tokenizer's chat template; with ``plan.windows``, window ``seed`` of
    the trace."""
    if plan.windows is not None:
        return load_hash_requests(plan.windows.path, plan.windows.scale(seed),
                                  ReplayConfig().vocab_size, max_tokens_cap=plan.max_tokens)
    from bench.workload import generate, measure_tokens_per_word, preset
    from replica.vllm.tiny_tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="kvroute-replay-") as tmp:
        tok = build_tokenizer(Path(tmp), template="llama3")
        trace = generate(preset("main", sessions=plan.sessions, seed=seed,
                                tokens_per_word=measure_tokens_per_word(tok)))
        return from_chat_trace(trace, tok, model=model, max_tokens_cap=plan.max_tokens)


async def _replay_seed(seed: int, plan: SeedPlan) -> list[SeedPoint]:
    base = ReplayConfig(replicas=plan.replicas, block_size=plan.block_size,
                        profile=plan.profile)
    specs = [parse_policy(p) for p in plan.policies]
    requests = workload(seed, plan, base.model)
    points = []
    for nb in plan.num_blocks:
        for naming in range(max(1, plan.namings)):
            cfg = ReplayConfig(replicas=plan.replicas, num_blocks=nb,
                               block_size=plan.block_size, profile=plan.profile,
                               naming=naming, routers=plan.routers,
                               shared_outlook=plan.shared_outlook)
            for spec in specs:
                run = await replay_run(spec.name, requests, spec.config(cfg))
                points.append(SeedPoint(seed, nb, naming, figures(spec.label, run.served),
                                        pooled_lru_share(run.served, requests, cfg),
                                        copies_of(run, requests, cfg).pooled_lru_less))
    return points


def replay_seed(seed: int, plan: SeedPlan) -> list[SeedPoint]:
    """Every pool size, naming and policy of ``plan`` on ``seed``'s workload."""
    return asyncio.run(_replay_seed(seed, plan))


def run_seeds(seeds: Sequence[int], plan: SeedPlan, *, jobs: int = 1) -> list[SeedPoint]:
    """``replay_seed`` for every seed, in ``jobs`` processes (1: in this one); the
    points in seed order whatever finished first."""
    if jobs <= 1 or len(seeds) <= 1:
        return [p for seed in seeds for p in replay_seed(seed, plan)]
    # Spawned, not forked: the parent may hold threads (the tokenizer's, asyncio's).
    # Each job stops when this process is gone, killed or not (a seed takes minutes).
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(seeds)), mp_context=ctx,
                             initializer=stop_with_parent, initargs=(os.getpid(),)) as pool:
        per_seed = list(pool.map(replay_seed, seeds, [plan] * len(seeds)))
    return [p for points in per_seed for p in points]


def mean_interval(values: Sequence[float], *, draws: int = BOOTSTRAP_DRAWS,
                  rng_seed: int = 0) -> tuple[float, float, float]:
    """The mean of ``values`` and a 95% percentile-bootstrap interval around it (one
    value: the interval is that value)."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    n = len(values)
    if n == 1:
        return mean, mean, mean
    rng = random.Random(rng_seed)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(draws))
    return mean, means[int(0.025 * draws)], means[min(draws - 1, int(0.975 * draws))]


def _bound_by_seed(points: Sequence[SeedPoint], num_blocks: int, policy: str,
                   *, less_copies: bool = False) -> list[float]:
    """Per seed, the median over its namings of the pooled LRU bound of ``policy``'s
    runs (``less_copies``: the bound less the copies those runs held)."""
    lru: dict[int, list[float]] = {}
    for p in points:
        if p.num_blocks == num_blocks and p.figures.policy == policy:
            lru.setdefault(p.seed, []).append(p.lru_less_copies if less_copies
                                              else p.pooled_lru)
    return [statistics.median(v) for v in lru.values()]


def _by_seed(points: Sequence[SeedPoint], num_blocks: int,
             policy: str) -> dict[int, tuple[float, float | None]]:
    """Seed -> (median cached share, median TTFT p99) over its namings."""
    cached: dict[int, list[float]] = {}
    p99: dict[int, list[float]] = {}
    for p in points:
        if p.num_blocks == num_blocks and p.figures.policy == policy:
            cached.setdefault(p.seed, []).append(p.figures.cached_share)
            if p.figures.ttft_p99_s is not None:
                p99.setdefault(p.seed, []).append(p.figures.ttft_p99_s)
    return {s: (statistics.median(v), statistics.median(p99[s]) if s in p99 else None)
            for s, v in cached.items()}


def format_seeds(points: Sequence[SeedPoint], num_blocks: int,
                 policies: Sequence[str]) -> str:
    """A Markdown table for one pool size (module docstring): per policy, the seeds,
    the mean and range of its cached share, the median and range of its TTFT p99, and
    against the first policy the seeds it is ahead on and the mean paired difference
    with its 95% interval; last, the pooled LRU bound over the first policy's runs, and
    that bound less the copies of blocks those runs held."""
    head = ["pool", "policy", "seeds", "cached, mean [range]", "TTFT p99, median [range]",
            "ahead of first", "difference, mean [95% interval]"]
    rows = [head, ["---"] * len(head)]
    first = _by_seed(points, num_blocks, policies[0]) if policies else {}
    for policy in policies:
        own = _by_seed(points, num_blocks, policy)
        if not own:
            continue
        cached = [c for c, _ in own.values()]
        p99s = [p for _, p in own.values() if p is not None]
        row = [str(num_blocks), policy, str(len(own)),
               f"{percent(statistics.fmean(cached))} [{percent(min(cached))}-"
               f"{percent(max(cached))}]",
               _ms_spread(p99s)]
        paired = [own[s][0] - first[s][0] for s in own if s in first]
        if policy == policies[0] or not paired:
            row += ["-", "-"]
        else:
            mean, lo, hi = mean_interval(paired)
            ahead = sum(1 for d in paired if d > 0)
            row += [f"{ahead}/{len(paired)}",
                    f"{signed_points(mean)} [{signed_points(lo)} to {signed_points(hi)}] points"]
        rows.append(row)
    for label, less in ((f"bound: pooled LRU ({policies[0]}'s order)", False),
                        (f"bound: pooled LRU less {policies[0]}'s copies", True)):
        lru = _bound_by_seed(points, num_blocks, policies[0], less_copies=less)
        if lru:
            rows.append([str(num_blocks), label, str(len(lru)),
                         f"{percent(statistics.fmean(lru))} [{percent(min(lru))}-"
                         f"{percent(max(lru))}]", "-", "-", "-"])
    return markdown_table(rows)


def _ms_spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return (f"{1000 * statistics.median(values):,.0f} ms "
            f"[{1000 * min(values):,.0f}-{1000 * max(values):,.0f}]")
