"""Policies compared over several seeds of the workload (``kvroute replay --seeds``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main
from kvroute.replay.seeds import SeedPlan, mean_interval, parse_seeds

SLICE = Path(__file__).parents[1] / "bench" / "data" / "mooncake_conversation_head300.jsonl"


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


def _trace_args(*extra: str) -> list[str]:
    return ["replay", "--hash-trace", str(SLICE), "--max-tokens", "8", "--num-blocks", "512",
            "--policies", "session,kv", *extra]


def test_the_seeds_of_a_hash_trace_are_its_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "windows.json"
    assert main(_trace_args("--seeds", "0-2", "--duration-s", "30", "--start-s", "5",
                            "--out", str(out))) == 0
    text = capsys.readouterr().out
    points = json.loads(out.read_text())["points"]
    assert [(p["seed"], p["policy"]) for p in points] == [
        (s, policy) for s in range(3) for policy in ("session", "kv")]
    assert "| 512 | kv | 3 |" in text
    # Window k is the trace from 5 + 30k s for 30 s: the figures of that window
    # replayed on its own.
    for seed in range(3):
        one = tmp_path / f"window-{seed}.json"
        assert main(_trace_args("--start-s", str(5 + 30 * seed), "--duration-s", "30",
                                "--out", str(one))) == 0
        alone = {p["policy"]: p for p in json.loads(one.read_text())["points"]}
        for p in (p for p in points if p["seed"] == seed):
            assert p["prompt_tokens"] == alone[p["policy"]]["prompt_tokens"] > 0
            assert p["cached_share"] == alone[p["policy"]]["cached_share"]
    assert len({p["prompt_tokens"] for p in points if p["policy"] == "kv"}) == 3
    # The table's last row: the pooled LRU bound over session's runs, seed by seed.
    lru = [p["pooled_lru"] for p in points if p["policy"] == "session"]
    assert all(0 < v <= 1 for v in lru)
    row = next(line for line in text.splitlines() if "bound: pooled LRU (" in line)
    assert row.startswith("| 512 | bound: pooled LRU (session's order) | 3 |")
    assert f"{100 * statistics.fmean(lru):.1f}% [{100 * min(lru):.1f}%-" in row
    # And that bound less the copies session's pools held: never above it.
    less = [p["lru_less_copies"] for p in points if p["policy"] == "session"]
    assert all(0 < v <= w for v, w in zip(less, lru, strict=True))
    row = next(line for line in text.splitlines() if "less session's copies" in line)
    assert f"| 3 | {100 * statistics.fmean(less):.1f}% [{100 * min(less):.1f}%-" in row


@pytest.mark.parametrize(("extra", "says"), [
    (["--hash-trace", "trace.jsonl"], "--duration-s"),
    (["--hash-trace", "missing.jsonl", "--duration-s", "60"], "missing.jsonl"),
    (["--hash-trace", str(SLICE), "--duration-s", "30", "--start-s", "-1"], "start"),
    (["--trace", "trace.jsonl"], "--trace"),
    (["--breakdown", "session"], "--breakdown"),
    (["--jobs", "0"], "--jobs"),
])
def test_kvroute_replay_refuses_seeds_with_what_they_do_not_take(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--seeds", "0-1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute replay:")
    assert says in err


def test_kvroute_replay_refuses_windows_past_the_end_of_the_trace(
    capsys: pytest.CaptureFixture[str]
) -> None:
    # The slice's last request is at 102 s: windows of 30 s from 0 go up to seed 3.
    assert main(_trace_args("--seeds", "2-4", "--duration-s", "30")) == 2
    err = capsys.readouterr().err
    assert "window 4 starts at 120 s" in err
    assert "at most 4 windows of 30 s" in err


def test_kvroute_replay_refuses_seeds_it_cannot_read(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--seeds", "3-1"]) == 2
    assert "--seeds: not a range" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [[], ["--no-shared-outlook"]])
def test_kvroute_replay_routers_share_the_look_ahead_unless_told_not_to(
    flag: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plans: list[SeedPlan] = []

    def run_seeds(seeds: Any, plan: SeedPlan, *, jobs: int = 1) -> list[Any]:
        plans.append(plan)
        return []

    monkeypatch.setattr("kvroute.replay.seeds.run_seeds", run_seeds)
    main(["replay", "--seeds", "0-1", "--routers", "2", "--policies", "kv", *flag])
    assert [(p.routers, p.shared_outlook) for p in plans] == [(2, not flag)]


def test_replay_jobs_stop_when_the_command_is_killed() -> None:
    """``kvroute replay --jobs N`` killed (SIGKILL: nothing passed on) leaves no job
    computing for nobody: each job stops once its parent is gone."""
    from tests.router.test_workers import _alive, children

    script = ("from kvroute.replay.seeds import SeedPlan, run_seeds; "
              "run_seeds([0, 1], SeedPlan(policies=('kv',), num_blocks=(600, 1024, 2048), "
              "namings=3), jobs=2)")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while len(jobs := children(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no jobs started"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(j) for j in jobs):
        assert time.monotonic() < deadline, "a replay job outlived the command"
        time.sleep(0.1)
