"""Figures of a replay run: cached share, simulated TTFT, moves, exact predictions, the
share of each cache bound (``bench.bounds``), and the fleet's copies of blocks.

The pooled bounds hold every block once; a fleet holds a block once per replica that
computed it (``kvroute.replay.copies``).  ``copies_of`` gives what that cost a run: the
copies its pools held on average, as a share of the fleet's blocks, and the share of
prompt tokens one pooled LRU cache serves with that much less capacity (the pooled LRU
figure for a fleet that holds those copies).  A policy's distance from the pooled LRU
bound so splits into the copies it kept and the rest."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.bounds import Bounds, CacheRequest, cache_bounds, pooled_lru_saved
from kvroute.replay.loop import ReplayConfig, ReplayRun, Served
from kvroute.replay.requests import ReplayRequest

__all__ = [
    "Copies",
    "RunFigures",
    "bounds_of",
    "copies_of",
    "figures",
    "format_namings",
    "format_table",
    "markdown_table",
    "percent",
    "pooled_lru_share",
    "signed_points",
]


@dataclass(frozen=True, slots=True)
class Copies:
    """What holding copies cost one run's fleet (module docstring)."""

    share: float
    """The copies the fleet's pools held, averaged over time, per block of capacity."""
    pooled_lru_less: float
    """The prompt tokens one LRU cache of the fleet's capacity less those copies serves
    from cache, as a share of the prompt tokens."""


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One policy's run, summarised."""

    policy: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    cached_share: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    later_turns: int
    moved_share: float | None
    """Later turns served on another replica than their previous turn."""
    exact_share: float | None
    """Later turns whose predicted cached tokens equal the reported ones (kv only)."""
    of_pooled_lru: float | None = None
    of_optimal: float | None = None
    of_unbounded: float | None = None
    copies_share: float | None = None
    """``Copies.share``, when counted."""
    lru_less_copies: float | None = None
    """``Copies.pooled_lru_less``, when counted."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _arrived(served: Sequence[Served], requests: Sequence[ReplayRequest]) -> list[CacheRequest]:
    """The requests served, in the order they arrived."""
    by_key = {(r.session, r.turn): r for r in requests}
    order = sorted((s for s in served if s.ok), key=lambda s: (s.arrival_s, s.session, s.turn))
    return [CacheRequest(r.tokens, r.max_tokens, r.cache_salt)
            for r in (by_key[(s.session, s.turn)] for s in order)]


def _capacity(cfg: ReplayConfig) -> int:
    """The fleet's usable blocks (each pool's null block left out)."""
    return cfg.replicas * (cfg.num_blocks - 1)


def bounds_of(
    served: Sequence[Served], requests: Sequence[ReplayRequest], cfg: ReplayConfig
) -> Bounds:
    """The cache bounds over the requests served, in the order they arrived."""
    return cache_bounds(_arrived(served, requests), block_size=cfg.block_size,
                        capacity=_capacity(cfg), model=cfg.model)


def _lru_share(
    served: Sequence[Served], requests: Sequence[ReplayRequest], cfg: ReplayConfig,
    capacity: int,
) -> float:
    """The share of the prompt tokens served that one LRU cache of ``capacity`` blocks
    serves from cache, in the order they arrived."""
    arrived = _arrived(served, requests)
    prompt = sum(len(r.tokens) for r in arrived)
    saved = pooled_lru_saved(arrived, block_size=cfg.block_size, capacity=capacity,
                             model=cfg.model)
    return saved / prompt if prompt else 0.0


def pooled_lru_share(
    served: Sequence[Served], requests: Sequence[ReplayRequest], cfg: ReplayConfig
) -> float:
    """The share of the prompt tokens served that one LRU cache of the fleet's capacity
    serves from cache, in the order they arrived (``bounds_of``'s pooled LRU alone)."""
    return _lru_share(served, requests, cfg, _capacity(cfg))


def copies_of(run: ReplayRun, requests: Sequence[ReplayRequest], cfg: ReplayConfig) -> Copies:
    """What the copies ``run``'s pools held cost it, against one pooled LRU cache of the
    fleet's capacity less them (module docstring)."""
    capacity = _capacity(cfg)
    less = max(1, round(capacity - run.mean_copies))
    return Copies(share=run.mean_copies / capacity,
                  pooled_lru_less=_lru_share(run.served, requests, cfg, less))


def figures(
    policy: str, served: Sequence[Served], bounds: Bounds | None = None,
    copies: Copies | None = None,
) -> RunFigures:
    """Summarise one run (``bounds``: the denominators, ``copies``: what copies cost it,
    if computed)."""
    ok = [s for s in served if s.ok]
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    later = [s for s in ok if s.previous_replica is not None]
    moved = sum(1 for s in later if s.replica != s.previous_replica)
    predicted = [s for s in later if s.predicted_cached_tokens is not None]
    exact = sum(1 for s in predicted if s.predicted_cached_tokens == s.cached_tokens)
    shares: dict[str, float | None] = bounds.share(cached) if bounds is not None else {}
    return RunFigures(
        policy=policy, requests=len(ok), errors=len(served) - len(ok), prompt_tokens=prompt,
        cached_tokens=cached, cached_share=cached / prompt if prompt else 0.0,
        ttft_p50_s=_pct(ttfts, 0.5), ttft_p99_s=_pct(ttfts, 0.99), later_turns=len(later),
        moved_share=moved / len(later) if later else None,
        exact_share=exact / len(predicted) if predicted else None,
        of_pooled_lru=shares.get("of_pooled_lru"), of_optimal=shares.get("of_optimal"),
        of_unbounded=shares.get("of_unbounded"),
        copies_share=copies.share if copies is not None else None,
        lru_less_copies=copies.pooled_lru_less if copies is not None else None,
    )


def percent(x: float | None) -> str:
    """A share as a table cell: ``52.3%``, or ``-`` when unknown."""
    return "-" if x is None else f"{100 * x:.1f}%"


def signed_points(x: float) -> str:
    """A difference of shares, in percentage points with its sign: ``+0.79``."""
    return f"{100 * x:+.2f}"


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the head and its ``---`` rule first) as a Markdown table."""
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:,.0f} ms"


def format_table(label: str, runs: Sequence[RunFigures], bounds: Bounds | None) -> str:
    """A Markdown table, one row per policy, then the bounds (``bounds``: those of the
    first run's arrival order; each run's shares use its own)."""
    head = ["pool", "policy", "cached", "of LRU", "of OPT", "of inf", "TTFT p50", "TTFT p99",
            "moved", "exact", "copies", "LRU less copies"]
    rows = [head, ["---"] * len(head)]
    for r in runs:
        rows.append([label, r.policy, percent(r.cached_share), percent(r.of_pooled_lru),
                     percent(r.of_optimal), percent(r.of_unbounded), _ms(r.ttft_p50_s),
                     _ms(r.ttft_p99_s),
                     percent(r.moved_share), percent(r.exact_share), percent(r.copies_share),
                     percent(r.lru_less_copies)])
    if bounds is not None:
        for name, share in bounds.shares().items():
            rows.append([label, f"bound: {name}", percent(share)] + ["-"] * (len(head) - 3))
    return markdown_table(rows)


def _spread(values: Sequence[float], fmt: str = "pct") -> str:
    show = percent if fmt == "pct" else _ms
    if not values:
        return "-"
    return f"{show(statistics.median(values))} [{show(min(values))}-{show(max(values))}]"


def format_namings(
    label: str, runs: Mapping[str, Sequence[RunFigures]], bounds: Bounds | None
) -> str:
    """A Markdown table over several namings of the replicas (``ReplayConfig.naming``),
    one row per policy: the median and range of its cached share and TTFT p99, and,
    naming by naming, how often and by how much it cached more than the first policy
    (the same hash assignment on both sides); then the bounds of the first run's
    arrival order."""
    head = ["pool", "policy", "namings", "cached", "of LRU", "TTFT p99", "moved", "exact",
            "copies", "LRU less copies", "ahead of first", "difference"]
    rows = [head, ["---"] * len(head)]
    first = next(iter(runs.values()), [])
    for policy, figs in runs.items():
        diffs = [f.cached_share - b.cached_share for f, b in zip(figs, first, strict=True)]
        ahead = sum(1 for d in diffs if d > 0)
        p99s = [f.ttft_p99_s for f in figs if f.ttft_p99_s is not None]
        rows.append([
            label, policy, str(len(figs)), _spread([f.cached_share for f in figs]),
            percent(_median([f.of_pooled_lru for f in figs])), _spread(p99s, "ms"),
            percent(_median([f.moved_share for f in figs])),
            percent(_median([f.exact_share for f in figs])),
            percent(_median([f.copies_share for f in figs])),
            percent(_median([f.lru_less_copies for f in figs])),
            "-" if figs is first else f"{ahead}/{len(diffs)}",
            "-" if figs is first else _signed_points(diffs),
        ])
    if bounds is not None:
        for name, share in bounds.shares().items():
            rows.append([label, f"bound: {name}", "-", percent(share)] + ["-"] * (len(head) - 4))
    return markdown_table(rows)


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _signed_points(diffs: Sequence[float]) -> str:
    return (f"{signed_points(statistics.median(diffs))} [{signed_points(min(diffs))} to "
            f"{signed_points(max(diffs))}] points")
