"""PNG plots of a comparison (matplotlib, headless ``Agg`` backend, small files).

* ``ttft_distribution``: the TTFT distribution of each run as an empirical CDF (log x).
* ``ttft_by_turn``: median TTFT against turn number per run, next to the prefill tokens a
  conversation has computed by that turn: without cache reuse every turn recomputes the
  whole history (linear per turn, quadratic in total); with reuse only the new tokens.

Contract: each function writes one PNG and returns its path; nothing is shown on screen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.report import computed_by_turn, ttft_by_turn, ttft_of
from bench.runner import RequestResult

Runs = Mapping[str, Sequence[RequestResult]]

_DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_distribution(runs: Runs, path: Path, *, time_scale: float) -> Path:
    """Empirical CDF of TTFT per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, results in runs.items():
        xs = sorted(t for r in results if r.ok and (t := ttft_of(r, time_scale)) is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step([x * 1000 for x in xs], ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, simulated)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def ttft_by_turn_plot(runs: Runs, path: Path, *, time_scale: float) -> Path:
    """Median TTFT by turn, and cumulative prefill computed by turn, per run."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, results in runs.items():
        by_turn = ttft_by_turn(results, time_scale)
        if by_turn:
            left.plot(list(by_turn), [v * 1000 for v in by_turn.values()], marker="o",
                      markersize=3, label=name)
        computed = computed_by_turn(results)
        total, cumulative = 0.0, []
        for v in computed.values():
            total += v
            cumulative.append(total)
        if cumulative:
            right.plot(list(computed), cumulative, marker="o", markersize=3, label=name)
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
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=name)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
