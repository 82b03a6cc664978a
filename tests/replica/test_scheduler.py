"""Scheduler timing and queueing properties (virtual time, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.pool_events import Removed, Stored
from replica.sim.scheduler import SimRequest

VOCAB = list(range(100, 1100))


def _engine(num_blocks: int = 256, **kw: object) -> SimEngine:
    cfg = EngineConfig(model="m", block_size=16, num_blocks=num_blocks, time_scale=0,
                       **kw)  # type: ignore[arg-type]
    return SimEngine(cfg, VOCAB)


def _req(eng: SimEngine, rid: str, prompt: list[int], max_tokens: int = 4,
         salt: str | None = None) -> SimRequest:
    keys = eng.scheduler.make_keys(prompt, cache_salt=salt, lora_name=None)
    return SimRequest(rid, prompt, max_tokens, keys=keys, cache_salt=salt, seed=len(rid))


def _drain(eng: SimEngine) -> None:
    for _ in range(100_000):
        if not eng.scheduler.has_work:
            return
        eng.step_virtual()
    raise AssertionError("engine did not drain")


def _ttft(r: SimRequest) -> float:
    assert r.first_token_s is not None
    return r.first_token_s - r.arrival_s


def test_turn_two_hits_the_cache_and_is_faster() -> None:
    eng = _engine()
    prompt = list(range(1, 501))
    a = _req(eng, "a", prompt, max_tokens=20)
    eng.scheduler.add(a, 0.0)
    _drain(eng)
    turn2 = a.tokens + list(range(2000, 2040))
    b = _req(eng, "b", turn2)
    eng.scheduler.add(b, eng.now())
    _drain(eng)
    # Everything but the partial tail block of the previous turn is a hit.
    assert b.num_cached_tokens == (len(a.tokens) // 16) * 16
    assert a.num_cached_tokens == 0
    # TTFT differs by exactly the prefill time of the tokens b did not have to compute.
    rate = eng.profile.prefill_s_per_token
    uncached_a, uncached_b = len(prompt), len(turn2) - b.num_cached_tokens
    assert _ttft(a) - _ttft(b) == pytest.approx((uncached_a - uncached_b) * rate)
    st_ = eng.scheduler.stats
    assert st_.prefix_hits == b.num_cached_tokens
    assert st_.prefix_queries == len(prompt) + len(turn2)


@settings(max_examples=25, deadline=None)
@given(shared=st.integers(0, 30), total=st.integers(32, 40))
def test_more_cached_tokens_never_raise_ttft(shared: int, total: int) -> None:
    eng = _engine()
    base = list(range(1, 16 * total + 1))
    warm = _req(eng, "w", base[: 16 * shared] if shared else [5000])
    eng.scheduler.add(warm, 0.0)
    _drain(eng)
    t0 = eng.now()
    less = _req(eng, "x", [9000] + base[1:])  # shares nothing
    eng.scheduler.add(less, t0)
    _drain(eng)
    t1 = eng.now()
    more = _req(eng, "y", base)
    eng.scheduler.add(more, t1)
    _drain(eng)
    assert more.num_cached_tokens >= less.num_cached_tokens
    assert _ttft(more) <= _ttft(less) + 1e-12


def test_chunked_prefill_respects_the_token_budget() -> None:
    eng = _engine(num_blocks=1024, max_num_batched_tokens=256)
    r = _req(eng, "long", list(range(1, 1001)))
    eng.scheduler.add(r, 0.0)
    plan = eng.scheduler.schedule(0.0)
    assert plan.scheduled == [(r, 256)]
    eng.scheduler.finish_step(plan, plan.duration_s)
    assert r.num_output == 0  # prefill not done
    _drain(eng)
    assert r.num_output == 4


def test_requests_queue_when_the_pool_is_full_and_run_later() -> None:
    eng = _engine(num_blocks=1 + 8)  # 8 usable blocks = 128 tokens
    reqs = [_req(eng, f"r{i}", [i * 1000 + j for j in range(1, 101)], max_tokens=8)
            for i in range(3)]
    for r in reqs:
        eng.scheduler.add(r, 0.0)
    eng.step_virtual()
    assert eng.num_running == 1 and eng.num_waiting == 2
    _drain(eng)
    assert all(r.finished for r in reqs)
    ttfts = [_ttft(r) for r in reqs]
    assert ttfts == sorted(ttfts) and ttfts[2] > ttfts[0] * 2


def test_decode_growth_preempts_the_last_running_request() -> None:
    eng = _engine(num_blocks=1 + 4)  # 64 tokens of KV
    a = _req(eng, "a", list(range(1, 31)), max_tokens=20)
    b = _req(eng, "b", list(range(100, 130)), max_tokens=20)
    eng.scheduler.add(a, 0.0)
    eng.scheduler.add(b, 0.0)
    _drain(eng)
    assert a.finished and b.finished
    assert eng.scheduler.stats.preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output == b.num_output == 20


def test_generated_blocks_are_stored_as_they_fill() -> None:
    eng = _engine()
    r = _req(eng, "g", list(range(1, 11)), max_tokens=30)
    eng.scheduler.add(r, 0.0)
    _drain(eng)
    stored = [e for e in eng.pool.take_events() if isinstance(e, Stored)]
    # 40 tokens, the last one never computed: blocks [0,16) and [16,32) get stored.
    assert [len(e.block_hashes) for e in stored] == [1, 1]
    assert stored[0].token_ids == r.tokens[:16] and stored[1].token_ids == r.tokens[16:32]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]


def test_outputs_are_deterministic_per_seed() -> None:
    outs = []
    for _ in range(2):
        eng = _engine()
        r = _req(eng, "same", list(range(1, 40)), max_tokens=12)
        eng.scheduler.add(r, 0.0)
        _drain(eng)
        outs.append(r.output_ids)
    assert outs[0] == outs[1] and len(set(outs[0])) > 1
    assert all(t in VOCAB for t in outs[0])


def test_eviction_under_pressure_emits_removals() -> None:
    eng = _engine(num_blocks=1 + 6)
    for i in range(4):
        r = _req(eng, f"e{i}", [i * 1000 + j for j in range(1, 50)], max_tokens=2)
        eng.scheduler.add(r, eng.now())
        _drain(eng)
    events = eng.pool.take_events()
    assert any(isinstance(e, Removed) for e in events)


def test_reset_prefix_cache_only_when_idle() -> None:
    eng = _engine()
    r = _req(eng, "a", list(range(1, 40)), max_tokens=50)
    eng.scheduler.add(r, 0.0)
    eng.step_virtual()
    assert not eng.reset_prefix_cache()
    _drain(eng)
    assert eng.reset_prefix_cache()
    r2 = _req(eng, "b", list(range(1, 40)))
    eng.scheduler.add(r2, eng.now())
    _drain(eng)
    assert r2.num_cached_tokens == 0


def test_host_tier_hit_counts_as_cached_and_costs_load_time() -> None:
    eng = _engine(num_blocks=1 + 8, cpu_offload_blocks=64)
    a = _req(eng, "a", list(range(1, 101)), max_tokens=2)
    eng.scheduler.add(a, 0.0)
    _drain(eng)
    # Push A's blocks out of the GPU pool.
    b = _req(eng, "b", list(range(5000, 5120)), max_tokens=2)
    eng.scheduler.add(b, eng.now())
    _drain(eng)
    assert not eng.pool.longest_hit(a.keys, 6)
    again = _req(eng, "a2", list(range(1, 101)), max_tokens=2)
    eng.scheduler.add(again, eng.now())
    _drain(eng)
    assert again.num_cached_tokens == 96
    assert eng.scheduler.stats.prefix_hits == 0  # local (GPU) hits only


def test_pending_latency_samples_stay_bounded_without_a_collector() -> None:
    eng = _engine()
    eng.scheduler.stats.max_pending = 10
    for i in range(40):
        eng.scheduler.add(_req(eng, f"r{i}", [i + 1] * 20, max_tokens=1), eng.now())
        _drain(eng)
    st_ = eng.scheduler.stats
    assert st_.finished == 40
    assert len(st_.e2e_latencies) <= 11 and len(st_.ttfts) <= 11


def test_a_request_that_arrives_after_a_steps_start_waits_for_the_next_step() -> None:
    eng = _engine()
    first = _req(eng, "a", list(range(1, 101)), max_tokens=50)
    eng.scheduler.add(first, 0.0)
    plan = eng.scheduler.schedule(0.0)
    eng.scheduler.finish_step(plan, plan.duration_s)
    late = _req(eng, "b", list(range(1, 101)))
    eng.scheduler.add(late, plan.duration_s + 0.001)
    # The engine plans the next step at the last one's end, before ``late`` arrived.
    nxt = eng.scheduler.schedule(plan.duration_s)
    assert [r.request_id for r, _n in nxt.scheduled] == ["a"]
    eng.scheduler.finish_step(nxt, plan.duration_s + nxt.duration_s)
    then = eng.scheduler.schedule(plan.duration_s + nxt.duration_s)
    assert {r.request_id for r, _n in then.scheduled} == {"a", "b"}
