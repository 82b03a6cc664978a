"""The same trace against several routing targets on one simulated fleet, plus the oracle.

A target is a kvroute policy (a fresh ``kvroute serve --policy NAME`` in front of the
fleet, and the ``X-KVRoute-Policy`` header on every request), or a peer router started
from a command line (``PeerSpec``), or ``direct`` (the first replica alone, no router).
Before each target every replica's prefix cache is emptied (``POST
/reset_prefix_cache``) and the router is new, so every target starts from equal caches.

The oracle (``bench.oracle``) needs the exact token ids the replicas hash: they come from
the replica's own ``POST /tokenize`` for each turn's messages (the trace's fixed replies
make these the prompts every target sends).

Peer routers: sglang-router tries to download a tokenizer for the model a replica reports,
and nothing may leave the machine, so peers run only inside a loopback-only network
namespace, with the replicas and the client (``bench.netns``; the CLI re-executes itself
inside one).  A peer command is a template: ``{port}`` becomes its port and ``{workers}``
the replica URLs separated by spaces (``{workers_comma}``: by commas).
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from bench.fleet import Fleet, FleetError, free_port
from bench.oracle import OracleRequest
from bench.runner import ProgressFn, RequestResult, RunConfig, Runner
from bench.trace import TraceRequest, by_session, conversation

POLICIES: tuple[str, ...] = ("round_robin", "random", "least_loaded", "session", "kv")
"""kvroute's policies, in the order the demo runs them."""


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A peer router: a name, a command template, and the path that answers 200 when
    it is ready."""

    name: str
    command: str
    ready_path: str = "/health"

    @classmethod
    def parse(cls, text: str) -> PeerSpec:
        """``name=vllm;cmd=vllm-router --port {port} --worker-urls {workers};ready=/health``."""
        fields: dict[str, str] = {}
        for part in text.split(";"):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"peer spec part {part!r} is not key=value")
            fields[key.strip()] = value.strip()
        if "name" not in fields or "cmd" not in fields:
            raise ValueError(f"peer spec needs name= and cmd=: {text!r}")
        return cls(fields["name"], fields["cmd"], fields.get("ready", "/health"))

    def argv(self, port: int, workers: Sequence[str]) -> list[str]:
        """The command line for ``port`` and the replica URLs."""
        filled = self.command.format(
            port=port, workers=" ".join(workers), workers_comma=",".join(workers)
        )
        return shlex.split(filled)


@dataclass(frozen=True, slots=True)
class Target:
    """One thing to benchmark."""

    name: str
    policy: str | None = None
    peer: PeerSpec | None = None

    @property
    def kind(self) -> str:
        """``policy``, ``peer`` or ``direct``."""
        return "policy" if self.policy else ("peer" if self.peer else "direct")


@dataclass(slots=True)
class TargetRun:
    """The outcome of one target."""

    target: Target
    results: list[RequestResult]
    wall_s: float
    error: str | None = None


async def tokenize_trace(
    url: str, trace: Sequence[TraceRequest], *, model: str, max_tokens_cap: int | None = None,
    concurrency: int = 8,
) -> list[OracleRequest]:
    """The trace's prompts as token ids (from the replica's ``/tokenize``), in trace order,
    for ``bench.oracle``."""
    jobs: list[tuple[TraceRequest, list[dict[str, Any]]]] = []
    for turns in by_session(trace).values():
        jobs.extend(zip(turns, conversation(turns), strict=True))
    order = {(r.session, r.turn): i for i, r in enumerate(sorted(
        trace, key=lambda r: (r.at, r.session, r.turn)))}
    out: list[OracleRequest | None] = [None] * len(jobs)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60.0)

    async def one(http: aiohttp.ClientSession, turn: TraceRequest,
                  messages: list[dict[str, Any]]) -> None:
        body = {"model": turn.model or model, "messages": messages,
                "add_generation_prompt": True}
        async with sem, http.post(url.rstrip("/") + "/tokenize", json=body) as resp:
            if resp.status != 200:
                raise FleetError(f"/tokenize failed (HTTP {resp.status}): "
                                 f"{(await resp.text())[:200]}")
            tokens = (await resp.json())["tokens"]
        gen = min(turn.max_tokens, max_tokens_cap or turn.max_tokens)
        out[order[(turn.session, turn.turn)]] = OracleRequest(tokens, gen, turn.cache_salt)

    async with aiohttp.ClientSession(timeout=timeout) as http, asyncio.TaskGroup() as tg:
        for turn, messages in jobs:
            tg.create_task(one(http, turn, messages))
    return [r for r in out if r is not None]


async def run_target(
    fleet: Fleet,
    target: Target,
    trace: Sequence[TraceRequest],
    base: RunConfig,
    progress: ProgressFn | None = None,
) -> TargetRun:
    """Reset the caches, bring the target up, replay the trace, take the target down."""
    await fleet.reset_caches()
    t0 = time.perf_counter()
    try:
        if target.policy is not None:
            async with fleet.router(target.policy) as url:
                cfg = replace(base, url=url, headers={**base.headers,
                                                      "X-KVRoute-Policy": target.policy})
                results = await _replay(cfg, trace, progress)
        elif target.peer is not None:
            port = free_port()
            argv = target.peer.argv(port, fleet.replica_urls)
            async with fleet.peer(target.name, argv, port, target.peer.ready_path) as url:
                results = await _replay(replace(base, url=url), trace, progress)
        else:
            results = await _replay(replace(base, url=fleet.replica_urls[0]), trace, progress)
    except FleetError as exc:
        return TargetRun(target, [], time.perf_counter() - t0, error=str(exc).splitlines()[0])
    return TargetRun(target, results, time.perf_counter() - t0)


async def _replay(
    cfg: RunConfig, trace: Sequence[TraceRequest], progress: ProgressFn | None
) -> list[RequestResult]:
    async with Runner(cfg) as runner:
        return await runner.run(trace, progress)


async def run_targets(
    fleet: Fleet,
    targets: Sequence[Target],
    trace: Sequence[TraceRequest],
    base: RunConfig,
    progress_for: Callable[[Target], tuple[ProgressFn | None, Callable[[], None]]] | None = None,
) -> list[TargetRun]:
    """``run_target`` for each target in turn.  ``progress_for(target)`` may return a
    per-request callback and a closer (for progress bars)."""
    runs: list[TargetRun] = []
    for target in targets:
        progress, close = progress_for(target) if progress_for else (None, lambda: None)
        try:
            runs.append(await run_target(fleet, target, trace, base, progress))
        finally:
            close()
    return runs
