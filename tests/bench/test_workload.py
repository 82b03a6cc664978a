"""The workload generator: seeded, deterministic, distributions with the intended shapes."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench import trace as trace_mod
from bench.workload import Dist, ThinkTime, WorkloadSpec, generate, preset, summarize


def test_same_seed_same_trace_different_seed_different_trace() -> None:
    spec = preset("small", sessions=20, seed=7)
    assert trace_mod.dumps(generate(spec)) == trace_mod.dumps(generate(spec))
    other = preset("small", sessions=20, seed=8)
    assert trace_mod.dumps(generate(other)) != trace_mod.dumps(generate(spec))


@pytest.mark.parametrize(
    ("dist", "mean"),
    [
        (Dist("fixed", 150), 150.0),
        (Dist("uniform", 100, 200), 150.0),
        (Dist("lognormal", 150, 0.5), 150 * math.exp(0.125)),
        (Dist("exponential", 20), 20.0),
    ],
)
def test_distribution_means_within_tolerance(dist: Dist, mean: float) -> None:
    rng = random.Random(1)
    xs = [dist.sample(rng) for _ in range(20_000)]
    assert statistics.fmean(xs) == pytest.approx(mean, rel=0.03)
    assert dist.mean() == pytest.approx(mean)


def test_lognormal_shape_median_and_log_spread() -> None:
    rng = random.Random(2)
    xs = [Dist("lognormal", 30, 0.8).sample(rng) for _ in range(20_000)]
    assert statistics.median(xs) == pytest.approx(30, rel=0.04)
    assert statistics.pstdev([math.log(x) for x in xs]) == pytest.approx(0.8, rel=0.04)


def test_clipping_and_parse() -> None:
    rng = random.Random(3)
    d = Dist("lognormal", 100, 2.0, lo=50, hi=120)
    assert all(50 <= d.sample(rng) <= 120 for _ in range(1000))
    assert Dist.parse("350") == Dist("fixed", 350)
    assert Dist.parse("uniform:10,20") == Dist("uniform", 10, 20)
    assert Dist.parse("lognormal:150,0.3") == Dist("lognormal", 150, 0.3)
    with pytest.raises(ValueError):
        Dist.parse("zipf:1")
    with pytest.raises(ValueError):
        Dist("uniform", 5, 1)


def test_think_time_has_a_tail_of_late_returners() -> None:
    think = ThinkTime(Dist("lognormal", 10, 0.5), Dist("lognormal", 300, 0.3), tail_share=0.2)
    rng = random.Random(4)
    xs = [think.sample(rng) for _ in range(20_000)]
    late = sum(x > 120 for x in xs) / len(xs)
    assert late == pytest.approx(0.2, abs=0.015)
    assert statistics.fmean(xs) == pytest.approx(think.mean(), rel=0.04)
    assert think.scaled(0.01).mean() == pytest.approx(think.mean() * 0.01)


def test_poisson_arrivals_and_trace_shape() -> None:
    spec = WorkloadSpec(
        sessions=2000,
        arrival_rate=4.0,
        turns=Dist("uniform", 2, 6),
        system_tokens=Dist("fixed", 20),
        user_tokens=Dist("fixed", 5),
        reply_tokens=Dist("fixed", 5),
        seed=5,
    )
    trace = generate(spec)
    s = summarize(trace)
    assert s["sessions"] == 2000
    assert s["arrival_gap_mean_s"] == pytest.approx(0.25, rel=0.06)
    assert s["turns_mean"] == pytest.approx(4.0, rel=0.05)
    starts = sorted(r.at for r in trace if r.turn == 1)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # exponential gaps: coefficient of variation 1
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)
    assert s["think_mean_s"] == pytest.approx(spec.think.mean(), rel=0.15)
    for turns in trace_mod.by_session(trace).values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        assert turns[0].system is not None and all(r.system is None for r in turns[1:])
        assert all(b.at >= a.at for a, b in zip(turns, turns[1:], strict=False))


def test_main_preset_lengths_and_sharing_modes() -> None:
    spec = preset("main", sessions=6, tenants=2)
    trace = generate(spec)
    first = [r for r in trace if r.turn == 1]
    assert all(len(r.system.split()) >= 1500 for r in first if r.system)
    assert all(len(r.user.split()) == 150 and r.max_tokens == 350 for r in trace)
    assert summarize(trace)["turns_mean"] == 10
    tenant_prompts = {r.tenant: r.system for r in first}
    assert len(set(tenant_prompts.values())) == 2  # per tenant
    assert len({r.system for r in generate(preset("shared", sessions=6)) if r.turn == 1}) == 1
    assert len({r.system for r in generate(preset("unique", sessions=6)) if r.turn == 1}) == 6


def test_salted_tenants_get_distinct_salts() -> None:
    trace = generate(preset("small", sessions=8, tenants=4, salted=True))
    salts = {r.tenant: r.cache_salt for r in trace}
    assert len(salts) == 4 and len(set(salts.values())) == 4 and None not in salts.values()
    assert all(r.cache_salt is None for r in generate(preset("small", sessions=4)))


def test_tokens_per_word_scales_text() -> None:
    a = generate(preset("small", sessions=2, user_tokens=Dist("fixed", 100)))
    b = generate(preset("small", sessions=2, user_tokens=Dist("fixed", 100), tokens_per_word=2))
    assert len(a[0].user.split()) == 100 and len(b[0].user.split()) == 50


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
