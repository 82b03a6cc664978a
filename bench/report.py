"""Summaries of benchmark runs: one row per policy (or endpoint), plus the cache bounds.

Figures per run (definitions, so the table can be read without the code):

* ``prompt_tokens``: sum of ``usage.prompt_tokens`` over successful requests.
* ``computed_tokens``: prefill tokens actually computed, ``prompt - cached``.
* ``cached_share``: ``cached / prompt``, with ``cached`` the engine's
  ``usage.prompt_tokens_details.cached_tokens``.
* ``of_pooled_lru``, ``of_optimal``, ``of_unbounded``: ``cached`` as a share of each cache
  bound (``bench.bounds``): one LRU cache of the fleet's total size, the same with
  optimal replacement that knows the future (an upper bound for any routing), and an
  infinite cache, each over the run's own requests in the order it sent them
  (``bounds``; ``bench.compare.arrival_bounds``).  The tables' bound rows give the
  median over the runs, with their spread where the runs' orders made them differ.
* ``ttft_p50/p90/p99``: time to first token in simulated seconds when the replicas report
  it (``usage.kvroute_sim.ttft_s``), else wall-clock TTFT divided by the time scale
  (``ttft_source`` says which).
* ``stay_share``: share of later turns (turn >= 2) that landed on the replica that served
  the previous turn of the same session (from ``x-kvroute-replica``).
* ``exact_share``: share of later turns with a prediction (kvroute's
  ``x-kvroute-predicted-cached-tokens``) whose engine-reported cached tokens equal it;
  ``None`` for a target that predicts nothing (round robin, the peers).
* ``spread``: requests per replica.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from bench.bounds import Bounds
from bench.runner import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_of(r: RequestResult, time_scale: float) -> float | None:
    """A request's TTFT in simulated seconds (see the module docstring)."""
    if r.sim_ttft_s is not None:
        return r.sim_ttft_s
    if r.ttft_s is not None:
        return r.ttft_s / time_scale
    return None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The figures of one run (see the module docstring)."""

    name: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    cached_share: float
    of_pooled_lru: float | None
    of_optimal: float | None
    of_unbounded: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    ttft_source: str
    stay_share: float | None
    exact_share: float | None = None
    spread: dict[str, int] = field(default_factory=dict)
    wall_s: float | None = None
    bounds: Bounds | None = None
    """The cache bounds the ``of_*`` shares are taken of."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def stay_share(results: Sequence[RequestResult]) -> float | None:
    """Share of later turns served by the previous turn's replica."""
    by_session: dict[str, list[RequestResult]] = {}
    for r in results:
        if r.ok and r.replica is not None:
            by_session.setdefault(r.session, []).append(r)
    stays = moves = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for a, b in zip(turns, turns[1:], strict=False):
            if b.turn == a.turn + 1:
                stays += a.replica == b.replica
                moves += a.replica != b.replica
    total = stays + moves
    return stays / total if total else None


def exact_share(results: Sequence[RequestResult]) -> float | None:
    """Share of predicted later turns whose cached tokens are what was predicted."""
    predicted = [r for r in results
                 if r.ok and r.turn >= 2 and r.predicted_cached_tokens is not None]
    if not predicted:
        return None
    exact = sum(r.predicted_cached_tokens == (r.cached_tokens or 0) for r in predicted)
    return exact / len(predicted)


def summarize(
    name: str,
    results: Sequence[RequestResult],
    *,
    time_scale: float,
    bounds: Bounds | None = None,
    wall_s: float | None = None,
) -> RunSummary:
    """The figures of one run."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttfts = [t for r in ok if (t := ttft_of(r, time_scale)) is not None]
    sim = any(r.sim_ttft_s is not None for r in ok)
    shares = bounds.share(cached) if bounds is not None else {}
    spread: dict[str, int] = {}
    for r in ok:
        if r.replica is not None:
            spread[r.replica] = spread.get(r.replica, 0) + 1
    return RunSummary(
        name=name,
        requests=len(results),
        errors=len(results) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        computed_tokens=prompt - cached,
        cached_share=cached / prompt if prompt else 0.0,
        of_pooled_lru=shares.get("of_pooled_lru"),
        of_optimal=shares.get("of_optimal"),
        of_unbounded=shares.get("of_unbounded"),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        ttft_source="simulated" if sim else "wall/time_scale",
        stay_share=stay_share(results),
        exact_share=exact_share(results),
        spread=dict(sorted(spread.items())),
        wall_s=wall_s,
        bounds=bounds,
    )


def ttft_by_turn(results: Sequence[RequestResult], time_scale: float) -> dict[int, float]:
    """Median TTFT (simulated seconds) per turn number."""
    groups: dict[int, list[float]] = {}
    for r in results:
        t = ttft_of(r, time_scale) if r.ok else None
        if t is not None:
            groups.setdefault(r.turn, []).append(t)
    return {turn: statistics.median(v) for turn, v in sorted(groups.items())}


def computed_by_turn(results: Sequence[RequestResult]) -> dict[int, float]:
    """Mean prefill tokens computed (prompt - cached) per turn number."""
    groups: dict[int, list[int]] = {}
    for r in results:
        if r.ok and r.prompt_tokens is not None:
            groups.setdefault(r.turn, []).append(r.prompt_tokens - (r.cached_tokens or 0))
    return {turn: statistics.fmean(v) for turn, v in sorted(groups.items())}


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _render(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    out = [line(cols), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def format_table(runs: Sequence[RunSummary]) -> str:
    """The comparison table, one row per run, then one per cache bound (``_bound_rows``)."""
    cols = ["policy", "prefill computed", "cached", "of LRU", "of OPT", "of inf", "TTFT p50",
            "p90", "p99", "same replica", "exact", "errors"]
    rows: list[list[str]] = []
    for s in runs:
        rows.append([
            s.name, f"{s.computed_tokens:,}", _fmt_pct(s.cached_share),
            _fmt_pct(s.of_pooled_lru), _fmt_pct(s.of_optimal), _fmt_pct(s.of_unbounded),
            _fmt_s(s.ttft_p50), _fmt_s(s.ttft_p90), _fmt_s(s.ttft_p99),
            _fmt_pct(s.stay_share), _fmt_pct(s.exact_share), str(s.errors),
        ])
    for name, computed, shares in _bound_rows(runs):
        rows.append([f"bound: {name}", f"{round(statistics.median(computed)):,}",
                     _spread_pct(shares, 0)] + ["-"] * (len(cols) - 3))
    return _render(cols, rows)


_BOUNDS: tuple[tuple[str, Callable[[Bounds], int]], ...] = (
    ("pooled LRU", attrgetter("pooled_lru_saved")),
    ("pooled optimal", attrgetter("pooled_optimal_saved")),
    ("unbounded", attrgetter("unbounded_saved")),
)
"""Each cache bound's name in the tables and its saved tokens."""


def _bound_rows(runs: Sequence[RunSummary]) -> list[tuple[str, list[int], list[float]]]:
    """Per cache bound: its name, and over the runs that have bounds, the prompt tokens
    it leaves to compute and its cached share."""
    known = [s.bounds for s in runs if s.bounds is not None and s.bounds.prompt_tokens]
    if not known:
        return []
    return [(name, [b.prompt_tokens - saved(b) for b in known],
             [saved(b) / b.prompt_tokens for b in known])
            for name, saved in _BOUNDS]


def typical_bounds(runs: Sequence[RunSummary]) -> Bounds | None:
    """The bounds of the run whose pooled LRU share is the (lower) median: the runs'
    bounds differ only in the order their requests arrived."""
    known = sorted((s.bounds for s in runs if s.bounds is not None and s.bounds.prompt_tokens),
                   key=lambda b: b.pooled_lru_saved / b.prompt_tokens)
    return known[(len(known) - 1) // 2] if known else None


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _spread_pct(values: Sequence[float], decimals: int = 1) -> str:
    """``median [min-max]`` of shares in percent (``decimals`` places); the median alone
    where every value reads the same."""
    if not values:
        return "-"
    lo, mid, hi = (f"{v:.{decimals}%}" for v in (min(values), statistics.median(values),
                                                 max(values)))
    return mid if lo == hi else f"{mid} [{lo}-{hi}]"


def _spread_s(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{_fmt_s(statistics.median(values))} [{_fmt_s(min(values))}-{_fmt_s(max(values))}]"


def format_repeats(rounds: Sequence[Sequence[RunSummary]]) -> str:
    """The comparison table over repeated rounds: per target, the median of its runs
    with the spread ``[min-max]`` of the cached share and the TTFT p99, the other
    columns as medians, errors summed; then one row per cache bound.  With several
    targets, each is also compared with the first round by round (the rounds' fleets
    differ, so every ring assigns the sessions anew; within a round all targets saw the
    same fleet): the rounds it cached more in, and its difference in points, mean
    [min to max]."""
    by_name: dict[str, list[RunSummary]] = {}
    for summaries in rounds:
        for s in summaries:
            by_name.setdefault(s.name, []).append(s)
    paired = len(by_name) > 1
    cols = ["policy", "runs", "cached", "of LRU", "of OPT", "of inf", "TTFT p50", "p99",
            "same replica", "exact", "errors"]
    if paired:
        cols += ["ahead of first", "difference"]
    first = next(iter(by_name), None)
    rows: list[list[str]] = []
    for name, runs in by_name.items():
        p99s = [s.ttft_p99 for s in runs if s.ttft_p99 is not None]
        rows.append([
            name, str(len(runs)), _spread_pct([s.cached_share for s in runs]),
            _fmt_pct(_median([s.of_pooled_lru for s in runs])),
            _fmt_pct(_median([s.of_optimal for s in runs])),
            _fmt_pct(_median([s.of_unbounded for s in runs])),
            _fmt_s(_median([s.ttft_p50 for s in runs])), _spread_s(p99s),
            _fmt_pct(_median([s.stay_share for s in runs])),
            _fmt_pct(_median([s.exact_share for s in runs])),
            str(sum(s.errors for s in runs)),
            *(_versus(rounds, first, name) if paired and first is not None else ()),
        ])
    for name, _computed, shares in _bound_rows([s for r in rounds for s in r]):
        rows.append([f"bound: {name}", "-", _spread_pct(shares)] + ["-"] * (len(cols) - 3))
    return _render(cols, rows)


def _versus(rounds: Sequence[Sequence[RunSummary]], first: str, name: str) -> list[str]:
    """``[ahead, difference]`` of ``name`` against ``first`` over the rounds that ran
    both: ``k/n`` and the cached share's difference in points, mean [min to max]."""
    if name == first:
        return ["-", "-"]
    diffs = []
    for summaries in rounds:
        by = {s.name: s for s in summaries}
        if name in by and first in by:
            diffs.append(100 * (by[name].cached_share - by[first].cached_share))
    if not diffs:
        return ["-", "-"]
    ahead = sum(d > 0 for d in diffs)
    return [f"{ahead}/{len(diffs)}",
            f"{statistics.fmean(diffs):+.2f} [{min(diffs):+.2f} to {max(diffs):+.2f}] points"]


def to_json(
    runs: Sequence[RunSummary],
    bounds: Bounds | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of a comparison."""
    doc: dict[str, Any] = {"runs": [r.to_json() for r in runs]}
    if bounds is not None:
        doc["bounds"] = {**asdict(bounds), **bounds.shares()}
    if extra:
        doc.update(extra)
    return doc
