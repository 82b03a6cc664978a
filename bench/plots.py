"""PNG plots of a comparison (matplotlib, headless ``Agg`` backend, small files).

* ``ttft_distribution``: the TTFT distribution of each run as an empirical CDF (log x).
* ``ttft_by_turn``: median TTFT against turn number per run, next to the prefill tokens a
  conversation has computed by that turn: without cache reuse every turn recomputes the
  whole history (linear per turn, quadratic in total); with reuse only the new tokens.

Contract: each function writes one PNG and returns its path; nothing is shown on screen.
A policy has the same colour in every plot whichever policies ran (``policy_color``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.report import computed_by_turn, ttft_by_turn, ttft_of
from bench.runner import RequestResult

Runs = Mapping[str, Sequence[RequestResult]]

_DPI = 90

POLICY_COLORS = {
    "round_robin": "#1f77b4",
    "random": "#ff7f0e",
    "least_loaded": "#2ca02c",
    "session": "#9467bd",
    "kv": "#d62728",
    "oracle": "#7f7f7f",
}
"""Fixed colours of the built-in policies (matplotlib's tab10 entries)."""
_OTHER_COLORS = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78",
                 "#98df8a", "#c5b0d5")
"""Peers and other targets: a colour chosen by name, none of the policies' colours."""


def policy_color(name: str) -> str:
    """The colour of ``name`` in every plot (stable across runs and processes)."""
    import zlib

    known = POLICY_COLORS.get(name)
    if known is not None:
        return known
    return _OTHER_COLORS[zlib.crc32(name.encode()) % len(_OTHER_COLORS)]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_distribution(runs: Runs, path: Path, *, time_scale: float) -> Path:
    """Empirical CDF of TTFT per run."""
    plt = _pyplot()
    fig = ttft_distribution_figure(runs, time_scale=time_scale)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _log_ms_axis(ax: Any, lo_ms: float, hi_ms: float) -> None:
    """A log x axis in milliseconds with plain-number labels, fewer the more decades it
    spans (1..9, 1-2-5, 1-3, then powers of ten), and no minor labels: matplotlib's
    default labels the minor ticks of a short range, and they overlap."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = math.log10(max(hi_ms, 1e-9) / max(lo_ms, 1e-9)) if lo_ms > 0 else 9.0
    subs: tuple[float, ...] = (1.0,)
    for most, steps in ((1.2, tuple(range(1, 10))), (2.5, (1, 2, 5)), (4.0, (1, 3))):
        if decades <= most:
            subs = tuple(float(x) for x in steps)
            break
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def ttft_distribution_figure(runs: Runs, *, time_scale: float) -> Any:
    """The figure ``ttft_distribution`` saves (the caller closes it)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lo, hi = float("inf"), 0.0
    for name, results in runs.items():
        xs = sorted(t for r in results if r.ok and (t := ttft_of(r, time_scale)) is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ms = [x * 1000 for x in xs]
        lo, hi = min(lo, ms[0]), max(hi, ms[-1])
        ax.step(ms, ys, where="post", label=name, color=policy_color(name))
    _log_ms_axis(ax, lo if hi > 0 else 1.0, hi if hi > 0 else 10.0)
    ax.set_xlabel("time to first token (ms, simulated)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def ttft_by_turn_plot(runs: Runs, path: Path, *, time_scale: float) -> Path:
    """Median TTFT by turn, and cumulative prefill computed by turn, per run."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, results in runs.items():
        by_turn = ttft_by_turn(results, time_scale)
        if by_turn:
            left.plot(list(by_turn), [v * 1000 for v in by_turn.values()], marker="o",
                      markersize=3, label=name, color=policy_color(name))
        computed = computed_by_turn(results)
        total, cumulative = 0.0, []
        for v in computed.values():
            total += v
            cumulative.append(total)
        if cumulative:
            right.plot(list(computed), cumulative, marker="o", markersize=3, label=name,
                       color=policy_color(name))
    left.set_xlabel("turn")
    left.set_ylabel("median TTFT (ms, simulated)")
    left.set_title("TTFT by turn")
    right.set_xlabel("turn")
    right.set_ylabel("prefill tokens computed so far")
    right.set_title("Prefill per conversation (cumulative)")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def sweep_plot(
    points: Sequence[Mapping[str, object]], path: Path, *, x: str, y: str, title: str
) -> Path:
    """One line per policy of ``y`` against ``x`` over sweep points
    (each point: ``{"policy", x, y}``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        xv, yv = p.get(x), p.get(y)
        if isinstance(xv, int | float) and isinstance(yv, int | float):
            series.setdefault(str(p["policy"]), []).append((float(xv), float(yv)))
    for name, pts in series.items():
        pts.sort()
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name,
                color=policy_color(name))
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
