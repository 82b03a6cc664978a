"""Pure parts of the comparison: peer specs, sweeps, think-time scaling, report figures."""

from __future__ import annotations

import pytest

from bench.bounds import Bounds, CacheRequest
from bench.compare import PeerSpec, arrival_bounds, parse_sweep, scale_think
from bench.report import (
    exact_share,
    format_repeats,
    format_table,
    percentile,
    stay_share,
    summarize,
)
from bench.runner import RequestResult
from bench.workload import generate, preset


def test_peer_spec_parse_and_argv() -> None:
    spec = PeerSpec.parse(
        "name=vllm;cmd=vllm-router --host 127.0.0.1 --port {port} --worker-urls {workers}"
    )
    assert spec.name == "vllm" and spec.ready_path == "/health"
    assert spec.argv(9000, ["http://a:1", "http://b:2"]) == [
        "vllm-router", "--host", "127.0.0.1", "--port", "9000", "--worker-urls",
        "http://a:1", "http://b:2"]
    metrics = PeerSpec.parse("name=m;cmd=r --port {port} --prometheus-port {aux}")
    assert metrics.argv(1, ["u"], aux=2) == ["r", "--port", "1", "--prometheus-port", "2"]
    comma = PeerSpec.parse("name=x;cmd=r --w {workers_comma};ready=/ready")
    assert comma.argv(1, ["u", "v"]) == ["r", "--w", "u,v"] and comma.ready_path == "/ready"
    with pytest.raises(ValueError):
        PeerSpec.parse("cmd=only")
    with pytest.raises(ValueError):
        PeerSpec.parse("name=x;oops")


def test_sweep_parsing_and_think_scaling() -> None:
    assert parse_sweep(["replicas=2,4", "think=0.5"]) == [
        ("replicas", [2.0, 4.0]), ("think", [0.5])]
    with pytest.raises(ValueError):
        parse_sweep(["colour=1"])
    trace = generate(preset("small", sessions=3))
    doubled = scale_think(trace, 2.0)
    assert [r.think_s * 2 for r in trace] == [r.think_s for r in doubled]
    assert [r.user for r in trace] == [r.user for r in doubled]


def res(session: str, turn: int, replica: str, prompt: int, cached: int,
        ttft: float, ok: bool = True, predicted: int | None = None,
        sent: float = 0.0) -> RequestResult:
    return RequestResult(session=session, turn=turn, tenant=None, scheduled_s=0, sent_s=sent,
                         status=200 if ok else 503, error=None if ok else "x",
                         ttft_s=ttft, sim_ttft_s=ttft / 10, replica=replica,
                         prompt_tokens=prompt, cached_tokens=cached,
                         predicted_cached_tokens=predicted)


def test_summary_figures() -> None:
    results = [
        res("a", 1, "r1", 100, 0, 1.0), res("a", 2, "r1", 200, 96, 0.5),
        res("a", 3, "r2", 300, 0, 2.0), res("b", 1, "r2", 100, 0, 1.0),
        res("b", 2, "r2", 200, 96, 0.4), res("b", 3, "r2", 300, 192, 0.3, ok=False),
    ]
    bounds = Bounds(prompt_tokens=1200, pooled_lru_saved=384, pooled_optimal_saved=480,
                    unbounded_saved=640)
    s = summarize("p", results, time_scale=0.1, bounds=bounds)
    assert (s.requests, s.errors, s.prompt_tokens, s.cached_tokens) == (6, 1, 900, 192)
    assert s.computed_tokens == 708 and s.of_pooled_lru == pytest.approx(0.5)
    assert s.of_optimal == pytest.approx(0.4) and s.of_unbounded == pytest.approx(0.3)
    assert s.ttft_source == "simulated" and s.ttft_p50 == pytest.approx(0.1)
    assert s.stay_share == pytest.approx(2 / 3)  # a1->a2 stays, a2->a3 moves, b1->b2 stays
    assert s.spread == {"r1": 2, "r2": 3}
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None
    assert stay_share([]) is None
    assert s.bounds == bounds
    table = format_table([s])
    assert "bound: pooled optimal" in table and "40%" in table


def test_repeated_rounds_are_reported_as_medians_with_their_spread() -> None:
    bounds = Bounds(prompt_tokens=900, pooled_lru_saved=300, pooled_optimal_saved=450,
                    unbounded_saved=600)
    rounds = []
    for cached, ttft in ((90, 1.0), (180, 3.0), (270, 2.0)):  # shares 10%, 20%, 30%
        results = [res("a", 1, "r1", 300, 0, ttft), res("a", 2, "r1", 600, cached, ttft)]
        rounds.append([summarize("kv", results, time_scale=0.1, bounds=bounds)])
    table = format_repeats(rounds)
    row = next(line for line in table.splitlines() if line.startswith("kv"))
    assert row.split()[1] == "3"  # runs
    assert "20.0% [10.0%-30.0%]" in row  # the median cached share and its spread
    assert "200 ms [100 ms-300 ms]" in row  # TTFT p99 (simulated: ttft / 10)
    assert "bound: pooled LRU" in table and "33.3%" in table


def test_several_targets_are_compared_with_the_first_round_by_round() -> None:
    rounds = []
    for a, b in ((90, 120), (180, 150), (270, 300)):  # kv: 10/20/30%, session 13.3/16.7/33.3%
        rounds.append([
            summarize("session", [res("s", 1, "r1", 300, 0, 1.0),
                                  res("s", 2, "r1", 600, b, 1.0)], time_scale=0.1),
            summarize("kv", [res("k", 1, "r1", 300, 0, 1.0),
                             res("k", 2, "r1", 600, a, 1.0)], time_scale=0.1),
        ])
    lines = format_repeats(rounds).splitlines()
    assert lines[0].split()[-4:] == ["ahead", "of", "first", "difference"]
    session = next(line for line in lines if line.startswith("session"))
    kv = next(line for line in lines if line.startswith("kv"))
    assert session.split()[-2:] == ["-", "-"]  # the first target is the reference
    # kv minus session, round by round: -3.33, +3.33, -3.33 points
    assert kv.split()[-6:] == ["1/3", "-1.11", "[-3.33", "to", "+3.33]", "points"]


def test_exact_predictions_count_predicted_later_turns_only() -> None:
    results = [
        res("a", 1, "r1", 100, 0, 1.0, predicted=0),  # a first turn: not counted
        res("a", 2, "r1", 200, 96, 0.5, predicted=96),  # exact
        res("a", 3, "r1", 300, 160, 0.5, predicted=192),  # over-predicted
        res("b", 2, "r2", 200, 96, 0.5),  # no prediction (another router)
        res("b", 3, "r2", 300, 192, 0.5, ok=False, predicted=192),  # failed: not counted
    ]
    assert exact_share(results) == pytest.approx(1 / 2)
    assert exact_share(results[3:4]) is None  # a target that predicts nothing
    s = summarize("kv", results, time_scale=0.1)
    assert s.exact_share == pytest.approx(1 / 2)
    header, _rule, row = format_table([s]).splitlines()
    assert header.split()[-2:] == ["exact", "errors"] and row.split()[-2:] == ["50%", "1"]
    rounds = [[s], [summarize("kv", results[:2], time_scale=0.1)]]
    row = format_repeats(rounds).splitlines()[2]
    assert row.split()[-2:] == ["75%", "1"]  # the median of 50% and 100%; errors summed


def test_each_run_is_measured_against_the_bounds_of_the_order_it_sent_its_requests() -> None:
    # Block size 1, a fleet of 2 blocks.  Conversations a and b each send a two-block
    # prompt, then extend it by one token (the second turn can hit both blocks).  Sent
    # a1, a2, b1, b2 (a's reply came back at once), a pooled LRU still holds each prompt
    # at its second turn: 4 hits.  Sent a1, b1, b2, a2 (a's reply was slow), b's blocks
    # evict a's before a2: 2 hits.  Each run is judged against its own order, and the
    # bound rows give the median with the spread.
    prompts = {("a", 1): CacheRequest([1, 9]), ("a", 2): CacheRequest([1, 9, 8]),
               ("b", 1): CacheRequest([2, 7]), ("b", 2): CacheRequest([2, 7, 6])}
    quick = [res("a", 1, "r1", 2, 0, 1.0, sent=0), res("a", 2, "r1", 3, 2, 1.0, sent=1),
             res("b", 1, "r1", 2, 0, 1.0, sent=2), res("b", 2, "r1", 3, 2, 1.0, sent=3)]
    slow = [res("a", 1, "r1", 2, 0, 1.0, sent=0), res("b", 1, "r1", 2, 0, 1.0, sent=1),
            res("b", 2, "r1", 3, 2, 1.0, sent=2), res("a", 2, "r1", 3, 0, 1.0, sent=9),
            res("c", 1, "r1", 5, 0, 1.0, ok=False, sent=3)]  # failed: left out
    quick_b = arrival_bounds(prompts, quick, block_size=1, capacity=2, model="m")
    slow_b = arrival_bounds(prompts, slow, block_size=1, capacity=2, model="m")
    assert quick_b.prompt_tokens == slow_b.prompt_tokens == 10
    assert (quick_b.pooled_lru_saved, slow_b.pooled_lru_saved) == (4, 2)
    assert quick_b.unbounded_saved == slow_b.unbounded_saved == 4
    runs = [summarize("p", quick, time_scale=0.1, bounds=quick_b),
            summarize("p", slow, time_scale=0.1, bounds=slow_b)]
    assert runs[0].of_pooled_lru == pytest.approx(1.0)  # 4 cached of its own 4
    assert runs[1].of_pooled_lru == pytest.approx(1.0)  # 2 cached of its own 2
    lru = next(line for line in format_repeats([[r] for r in runs]).splitlines()
               if line.startswith("bound: pooled LRU"))
    assert "30.0% [20.0%-40.0%]" in lru
    unbounded = next(line for line in format_table(runs).splitlines()
                     if line.startswith("bound: unbounded"))
    assert unbounded.split()[2:4] == ["6", "40%"]  # the same for both runs: no spread
