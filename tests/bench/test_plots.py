"""The plots: readable axes and one colour per policy in every plot."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from bench import plots
from bench.runner import RequestResult


def _results(ttfts_s: list[float]) -> list[RequestResult]:
    return [RequestResult(session=f"s{i % 4}", turn=i // 4 + 1, tenant=None, scheduled_s=0.0,
                          sent_s=0.0, status=200, sim_ttft_s=t, prompt_tokens=100 * (i + 1),
                          cached_tokens=50 * i)
            for i, t in enumerate(ttfts_s)]


def _spread(lo_s: float, hi_s: float, n: int = 40) -> list[float]:
    return [lo_s * (hi_s / lo_s) ** (i / (n - 1)) for i in range(n)]


@pytest.mark.parametrize(("lo_s", "hi_s"), [(0.02, 0.08), (0.015, 0.4), (0.005, 20.0),
                                             (0.03, 0.031), (0.001, 900.0)])
def test_ttft_distribution_x_labels_do_not_overlap(lo_s: float, hi_s: float) -> None:
    runs = {"kv": _results(_spread(lo_s, hi_s)), "round_robin": _results(_spread(lo_s, hi_s))}
    fig = plots.ttft_distribution_figure(runs, time_scale=1.0)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        lo, hi = ax.get_xlim()
        labels = [t for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
                  if t.get_text() and lo <= t.get_position()[0] <= hi]
        texts = [t.get_text() for t in labels]
        assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
        boxes = [t.get_window_extent(renderer) for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), [t.get_text() for t in labels]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _line_colors(fig: Any) -> dict[str, str]:
    from matplotlib.colors import to_hex

    return {line.get_label(): to_hex(line.get_color()) for ax in fig.axes
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_a_policy_keeps_its_colour_whichever_policies_ran(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    seen: dict[str, set[str]] = {}
    for names in (["kv"], ["session", "kv"], ["round_robin", "random", "least_loaded",
                                               "session", "kv"], ["peer-x", "kv"]):
        runs = {n: _results(_spread(0.01, 1.0, 8)) for n in names}
        fig = plots.ttft_distribution_figure(runs, time_scale=1.0)
        for name, color in _line_colors(fig).items():
            seen.setdefault(name, set()).add(color)
        plt.close(fig)
        plots.ttft_by_turn_plot(runs, tmp_path / "t.png", time_scale=1.0)
    assert {n: len(c) for n, c in seen.items()} == dict.fromkeys(seen, 1)
    colors = {n: c.pop() for n, c in seen.items()}
    assert len(set(colors.values())) == len(colors)  # no two policies share one
    assert colors["kv"] == plots.policy_color("kv") and "peer-x" in colors
