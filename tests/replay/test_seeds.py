"""Policies compared over several seeds of the workload (``kvroute replay --seeds``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main
from kvroute.replay.seeds import mean_interval, parse_seeds


def test_seeds_are_read_from_ranges_and_lists_once_each() -> None:
    assert parse_seeds("0-3") == [0, 1, 2, 3]
    assert parse_seeds("5, 1,2-4 ,2") == [5, 1, 2, 3, 4]
    assert parse_seeds("7") == [7]
    for bad in ("", "a", "3-1", "-2", "1-x", ","):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_the_interval_of_a_mean_holds_it_and_is_the_same_every_time() -> None:
    diffs = [0.012, -0.004, 0.02, 0.001, -0.009, 0.015, 0.007, 0.003]
    mean, lo, hi = mean_interval(diffs)
    assert mean == pytest.approx(statistics.fmean(diffs))
    assert min(diffs) < lo < mean < hi < max(diffs)
    assert mean_interval(diffs) == (mean, lo, hi)
    # A spread twice as wide gives an interval twice as wide around the same mean.
    wide = [mean + 2 * (d - mean) for d in diffs]
    m2, lo2, hi2 = mean_interval(wide)
    assert m2 == pytest.approx(mean)
    assert hi2 - lo2 == pytest.approx(2 * (hi - lo))
    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError):
        mean_interval([])


def _run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: int
) -> tuple[str, list[dict[str, Any]]]:
    out = tmp_path / f"seeds-{jobs}.json"
    code = main(["replay", "--seeds", "0-2", "--sessions", "6", "--max-tokens", "8",
                 "--num-blocks", "256", "--policies", "session,kv", "--namings", "2",
                 "--jobs", str(jobs), "--out", str(out)])
    assert code == 0
    return capsys.readouterr().out, json.loads(out.read_text())["points"]


def test_kvroute_replay_over_seeds_pairs_the_policies_seed_by_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, points = _run(tmp_path, capsys, jobs=2)
    assert [(p["seed"], p["naming"], p["policy"]) for p in points] == [
        (s, n, policy) for s in range(3) for n in range(2) for policy in ("session", "kv")]
    # Each seed draws other conversations.
    prompts = {s: sum(p["prompt_tokens"] for p in points
                      if p["seed"] == s and p["policy"] == "kv" and p["naming"] == 0)
               for s in range(3)}
    assert len(set(prompts.values())) == 3

    def per_seed(policy: str) -> list[float]:
        return [statistics.median(p["cached_share"] for p in points
                                  if p["seed"] == s and p["policy"] == policy)
                for s in range(3)]

    kv, session = per_seed("kv"), per_seed("session")
    diffs = [a - b for a, b in zip(kv, session, strict=True)]
    mean, lo, hi = mean_interval(diffs)
    row = next(line for line in text.splitlines() if line.startswith("| 256 | kv |"))
    assert f"| {sum(1 for d in diffs if d > 0)}/3 |" in row
    assert f"{100 * mean:+.2f} [{100 * lo:+.2f} to {100 * hi:+.2f}] points" in row
    assert f"{100 * statistics.fmean(kv):.1f}% [{100 * min(kv):.1f}%-" in row
    # One process or two: the same figures.
    _, again = _run(tmp_path, capsys, jobs=1)
    assert again == points


@pytest.mark.parametrize("extra", [
    ["--hash-trace", "trace.jsonl"],
    ["--breakdown", "session"],
    ["--jobs", "0"],
])
def test_kvroute_replay_refuses_seeds_with_what_they_do_not_take(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--seeds", "0-1", *extra]) == 2
    assert "kvroute replay:" in capsys.readouterr().err


def test_kvroute_replay_refuses_seeds_it_cannot_read(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--seeds", "3-1"]) == 2
    assert "--seeds: not a range" in capsys.readouterr().err
