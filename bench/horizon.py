"""The turn-2 probe: how long does a conversation's prefix survive in the cache?

For each pause (e.g. 0, 10, 30, 60, 120 s), a two-turn conversation that starts with a
unique nonce (so nothing else can have cached it) is sent; after turn 1's reply the probe
waits the pause and sends turn 2, which repeats turn 1's prompt plus a reply and a new
user message.  If turn 1's blocks are still cached, turn 2 computes only its new tokens;
once they are evicted, it recomputes everything, and its TTFT jumps.  The pause at which
that happens is the eviction horizon under the current load: the longest a user can
think before their next turn costs a full prefill.

* All probes run concurrently, each with its own nonce; ``repeats`` probes per pause.
* Optional background load: unique prompts at ``background_rps`` requests per (trace)
  second, to make the cache churn as production traffic would.  ``warmup_s`` of it runs
  before the probes so the pool is already full of older blocks.
* ``time_scale`` (wall seconds per simulated second) multiplies every pause and the
  background rate, so against a simulated fleet the probe of minutes takes seconds.  TTFT
  comes from the simulated replica's report when asked for (``sim_timing``), else from
  the wall clock divided by the time scale.
* The horizon: the first pause whose median turn-2 ``cached_tokens`` falls below half of
  the 0-pause median; when the endpoint reports no ``cached_tokens``, the first pause
  whose median turn-2 TTFT is more than twice the 0-pause median.  Reported as the
  bracket between that pause and the one before it.

Probes go through any OpenAI-compatible URL: a replica, or a router (the probe sends
``X-Session-ID``, so a session-affine or KV-aware router keeps both turns together).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.runner import RequestResult, RunConfig, Runner
from bench.trace import TraceRequest, conversation
from bench.workload import words

DEFAULT_PAUSES: tuple[float, ...] = (0.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """How to probe."""

    url: str
    model: str
    pauses: tuple[float, ...] = DEFAULT_PAUSES
    repeats: int = 3
    prompt_tokens: int = 1024
    """Size of turn 1's prompt (words at ``tokens_per_word``)."""
    tokens_per_word: float = 1.0
    time_scale: float = 1.0
    sim_timing: bool = False
    background_rps: float = 0.0
    background_tokens: int = 512
    background_poisson: bool = True
    """Poisson background arrivals (else evenly spaced)."""
    warmup_s: float = 0.0
    max_tokens: int = 8
    headers: dict[str, str] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.pauses or any(p < 0 for p in self.pauses):
            raise ValueError("pauses must be non-empty and >= 0")
        if self.repeats < 1 or self.time_scale <= 0:
            raise ValueError("repeats must be >= 1 and time_scale > 0")


@dataclass(frozen=True, slots=True)
class PauseResult:
    """Turn-2 figures for one pause (medians over the repeats)."""

    pause_s: float
    ttft_s: float | None
    cached_tokens: float | None
    prompt_tokens: float | None
    errors: int


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The probe's outcome."""

    pauses: list[PauseResult]
    horizon_s: float | None
    """The first pause at which turn 2 missed (``None``: it never missed)."""
    last_hit_s: float | None
    """The last pause before ``horizon_s`` (the horizon lies between the two)."""
    signal: str
    """``cached_tokens`` or ``ttft``: what decided."""
    background_requests: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def find_horizon(
    pauses: Sequence[PauseResult],
) -> tuple[float | None, float | None, str]:
    """``(horizon, last_hit, signal)`` from per-pause medians (see the module docstring)."""
    ordered = sorted(pauses, key=lambda p: p.pause_s)
    if not ordered:
        return None, None, "none"
    base = ordered[0]
    if base.cached_tokens is not None and base.cached_tokens > 0:
        signal = "cached_tokens"

        def missed(p: PauseResult) -> bool:
            return p.cached_tokens is None or p.cached_tokens < base.cached_tokens / 2  # type: ignore[operator]
    else:
        signal = "ttft"

        def missed(p: PauseResult) -> bool:
            return (base.ttft_s is not None and p.ttft_s is not None
                    and p.ttft_s > 2 * base.ttft_s)
    last_hit: float | None = base.pause_s
    for p in ordered[1:]:
        if missed(p):
            return p.pause_s, last_hit, signal
        last_hit = p.pause_s
    return None, last_hit, signal


class Prober:
    """Runs the probe (see the module docstring)."""

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._run_cfg = RunConfig(
            url=config.url, model=config.model, time_scale=config.time_scale,
            sim_timing=config.sim_timing, headers=dict(config.headers),
            max_tokens_cap=config.max_tokens,
        )

    def _turns(self, tag: str) -> list[TraceRequest]:
        cfg = self.config
        nonce = uuid.UUID(int=self._rng.getrandbits(128)).hex
        system = f"probe {nonce} {tag}. " + words(self._rng, cfg.prompt_tokens, cfg.tokens_per_word)
        return [
            TraceRequest(session=f"probe-{nonce}", turn=1, at=0.0, user="first question",
                         max_tokens=cfg.max_tokens, system=system, reply="a short reply."),
            TraceRequest(session=f"probe-{nonce}", turn=2, at=0.0, user="second question",
                         max_tokens=cfg.max_tokens),
        ]

    async def _probe(self, runner: Runner, pause: float, i: int) -> RequestResult | None:
        turns = self._turns(f"pause {pause} #{i}")
        msgs = list(conversation(turns))
        first, _ = await runner.send(turns[0], msgs[0])
        if not first.ok:
            return None
        await asyncio.sleep(pause * self.config.time_scale)
        second, _ = await runner.send(turns[1], msgs[1])
        return second

    async def _background(self, runner: Runner, stop: asyncio.Event, counter: list[int]) -> None:
        cfg = self.config
        interval = cfg.time_scale / cfg.background_rps
        async with asyncio.TaskGroup() as tg:
            next_t = time.perf_counter()
            while not stop.is_set():
                turn = TraceRequest(
                    session=f"bg-{uuid.UUID(int=self._rng.getrandbits(128)).hex}", turn=1,
                    at=0.0, max_tokens=1,
                    user=words(self._rng, cfg.background_tokens, cfg.tokens_per_word),
                )
                tg.create_task(runner.send(turn, list(conversation([turn]))[0]))
                counter[0] += 1
                next_t += interval * (self._rng.expovariate(1.0) if cfg.background_poisson
                                      else 1.0)
                delay = next_t - time.perf_counter()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)

    async def run(self) -> ProbeResult:
        """Probe every pause; returns per-pause medians and the horizon."""
        cfg = self.config
        stop = asyncio.Event()
        counter = [0]
        results: dict[float, list[RequestResult | None]] = {}
        async with Runner(self._run_cfg) as runner, asyncio.TaskGroup() as outer:
            bg = None
            if cfg.background_rps > 0:
                bg = outer.create_task(self._background(runner, stop, counter))
                await asyncio.sleep(cfg.warmup_s * cfg.time_scale)
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = {
                        (p, i): tg.create_task(self._probe(runner, p, i))
                        for p in cfg.pauses for i in range(cfg.repeats)
                    }
            finally:
                stop.set()
            if bg is not None:
                await bg
            for (p, _), t in tasks.items():
                results.setdefault(p, []).append(t.result())
        pauses = [self._summarize(p, rs) for p, rs in sorted(results.items())]
        horizon, last_hit, signal = find_horizon(pauses)
        return ProbeResult(pauses, horizon, last_hit, signal, counter[0])

    def _summarize(self, pause: float, rs: list[RequestResult | None]) -> PauseResult:
        ok = [r for r in rs if r is not None and r.ok]
        ttfts = [t for r in ok if (t := (r.sim_ttft_s if r.sim_ttft_s is not None else
                                         (r.ttft_s / self.config.time_scale
                                          if r.ttft_s is not None else None))) is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        return PauseResult(
            pause_s=pause,
            ttft_s=statistics.median(ttfts) if ttfts else None,
            cached_tokens=statistics.median(cached) if cached else None,
            prompt_tokens=statistics.median(prompt) if prompt else None,
            errors=len(rs) - len(ok),
        )


def format_table(result: ProbeResult) -> str:
    """The per-pause table and the horizon line."""
    lines = [f"{'pause':>8}  {'turn-2 TTFT':>11}  {'cached':>7}  {'prompt':>7}  errors"]
    for p in result.pauses:
        ttft = "-" if p.ttft_s is None else f"{p.ttft_s * 1000:.0f} ms"
        cached = "-" if p.cached_tokens is None else f"{p.cached_tokens:.0f}"
        prompt = "-" if p.prompt_tokens is None else f"{p.prompt_tokens:.0f}"
        lines.append(f"{p.pause_s:>7g}s  {ttft:>11}  {cached:>7}  {prompt:>7}  {p.errors}")
    if result.horizon_s is None:
        lines.append(f"no eviction seen up to {max(p.pause_s for p in result.pauses):g} s "
                     f"(signal: {result.signal})")
    else:
        lines.append(f"eviction horizon: between {result.last_hit_s:g} s and "
                     f"{result.horizon_s:g} s (signal: {result.signal})")
    if result.background_requests:
        lines.append(f"background load: {result.background_requests} requests")
    return "\n".join(lines)
