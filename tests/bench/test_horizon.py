"""The turn-2 probe: horizon detection logic, and the probe on a real simulated replica
(a child process) finding the horizon its pool size and the background load imply."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.fleet import Fleet, FleetSpec
from bench.horizon import PauseResult, ProbeConfig, Prober, find_horizon, format_table
from bench.workload import tokens_per_word


def pr(pause: float, ttft: float | None, cached: float | None) -> PauseResult:
    return PauseResult(pause, ttft, cached, 600, 0)


def test_find_horizon_by_cached_tokens_then_by_ttft() -> None:
    by_cache = [pr(0, 0.02, 512), pr(10, 0.03, 512), pr(30, 0.02, 100), pr(60, 0.2, 0)]
    assert find_horizon(by_cache) == (30, 10, "cached_tokens")
    by_ttft = [pr(0, 0.02, None), pr(10, 0.03, None), pr(30, 0.05, None)]
    assert find_horizon(by_ttft) == (30, 10, "ttft")
    never = [pr(0, 0.02, 512), pr(10, 0.02, 512)]
    assert find_horizon(never) == (None, 10, "cached_tokens")


@pytest.mark.slow
async def test_probe_finds_the_horizon_of_a_simulated_replica(llama3_dir: Path) -> None:
    tok = Tokenizer.from_file(str(llama3_dir / "tokenizer.json"))
    tpw = tokens_per_word(lambda s: tok.encode(s, add_special_tokens=False).ids)
    block, num_blocks, scale, rps = 16, 512, 0.05, 2.0
    spec = FleetSpec(tokenizer=llama3_dir, replicas=1, block_size=block, num_blocks=num_blocks,
                     time_scale=scale, router=False)
    pauses = (0.0, 1.5, 3.0, 6.0, 12.0, 24.0)
    async with Fleet(spec) as fleet:
        cfg = ProbeConfig(
            url=fleet.url, model=spec.model, pauses=pauses, repeats=1, prompt_tokens=500,
            tokens_per_word=tpw, time_scale=scale, sim_timing=True, background_rps=rps,
            background_tokens=500, background_poisson=False, warmup_s=12.0,
        )
        result = await Prober(cfg).run()
    table = format_table(result)
    assert all(p.errors == 0 for p in result.pauses), table
    assert result.signal == "cached_tokens"
    assert result.horizon_s is not None and result.last_hit_s is not None, table
    # What the pool implies: the probes' own blocks sit at the young end of the LRU queue;
    # the background (one unique ~prompt-sized request per 1/rps s) evicts the older
    # blocks first, then theirs.
    prompt = result.pauses[0].prompt_tokens or 0
    probe_blocks = (len(pauses) + 1) * (prompt // block)
    expected = (num_blocks - 1 - probe_blocks) / (rps * (prompt // block))
    assert result.last_hit_s <= expected * 1.6, (expected, table)
    assert result.horizon_s >= expected / 1.6, (expected, table)
    assert result.pauses[0].cached_tokens and result.pauses[0].cached_tokens >= prompt // 2


def test_probe_config_validation() -> None:
    with pytest.raises(ValueError):
        ProbeConfig(url="u", model="m", pauses=())
