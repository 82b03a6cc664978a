"""``kvroute bench soak``: steady multi-turn traffic through a router while its world breaks.

On a simulated fleet with the Redis index (``bench.soak_fleet``), ``conversations``
clients hold multi-turn chats (streamed, usage asked for) for ``duration_s`` while a
fault is injected every ``fault_interval_s``, in turn:

* ``replica_kill``: SIGKILL a replica (in-flight requests die), restart it 3 s later;
* ``events_dropped``: a replica sends its next event batches to nobody (a sequence gap);
* ``redis_kill``: SIGKILL Redis, restart it empty 2 s later;
* ``events_corrupted``: a replica publishes malformed ``BlockStored`` events;
* ``redis_flush``: ``FLUSHALL`` while Redis stays up;

and about one streamed request in ten is abandoned by its client after the first chunk.

Then the faults stop, the soak waits until ``/ready`` reports every event source live
(``recovered_after_s``), and fresh conversations measure whether predictions are exact
again: once the router's dry-run prediction for a later turn has settled (within
``settle_timeout_s``: the previous turn's events arrived), that turn's
``x-kvroute-predicted-cached-tokens`` against the replica's ``cached_tokens``
(``exact_after_recovery``, ``over_after_recovery``).

The report counts requests ``sent``, ``completed``, ``failed_over`` (the router's
``router_failovers_total``), ``mid_stream_errors`` (streams past their first byte that
ended with an error event: the only failure a client may see), ``abandoned`` (by the
client, on purpose) and ``failed`` (lost: an error status or a broken connection before
any byte; must be 0), samples of the router's RSS and open file descriptors over time,
and ``unhandled_exceptions`` (tracebacks in the router's log).

The router runs with small memory budgets (``bench.soak_fleet.SOAK_MEMORY``, ~11 MB of
prompt memos and session state, full within the first half minute), so its RSS levels
off early and growth after that is a leak; ``--default-memory`` keeps the router's
defaults (hundreds of MB that take many minutes to fill).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_fleet import SOAK_MEMORY, SoakFleet, SoakFleetSpec

__all__ = ["SoakReport", "SoakSpec", "main", "passed", "register", "run_soak"]

FAULTS = ("replica_kill", "events_dropped", "redis_kill", "events_corrupted", "redis_flush")


@dataclass(frozen=True, slots=True)
class SoakSpec:
    """How long and how hard."""

    fleet: SoakFleetSpec
    duration_s: float = 300.0
    conversations: int = 6
    fault_interval_s: float = 10.0
    sample_interval_s: float = 5.0
    recovery_timeout_s: float = 60.0
    recovery_conversations: int = 4
    recovery_pause_s: float = 0.5
    """A user's pause between turns after recovery."""
    settle_timeout_s: float = 10.0
    """After recovery, the N seconds within which the router's prediction for the next
    turn must settle (two equal dry runs, ``/debug/route``, 0.5 s apart) before the turn
    is sent and its prediction compared with the replica's cached tokens."""
    abandon_share: float = 0.1
    faults: tuple[str, ...] = FAULTS
    """The faults injected, in turn (a subset of ``FAULTS``)."""
    seed: int = 0


@dataclass
class SoakReport:
    """What happened (see the module docstring)."""

    sent: int = 0
    completed: int = 0
    failed_over: int = 0
    mid_stream_errors: int = 0
    abandoned: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list)
    """``{"t": seconds since start, "rss_mib": ..., "open_fds": ..., "sent": requests
    sent so far}``."""
    recovered_after_s: float | None = None
    exact_after_recovery: int = 0
    checked_after_recovery: int = 0
    over_after_recovery: int = 0
    recovery_turns: list[tuple[int | None, int | None]] = field(default_factory=list)
    """(predicted, cached) tokens of each later turn checked after recovery."""
    unhandled_exceptions: int = 0
    duration_s: float = 0.0

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(asdict(self), indent=2)


class _Client:
    """Sends chat turns and counts what came back."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str,
                 report: SoakReport, rng: random.Random, abandon_share: float) -> None:  # fmt: skip
        self._http, self._url, self._model = http, url, model
        self._report, self._rng, self._abandon = report, rng, abandon_share

    async def turn(self, messages: list[dict[str, str]], *, may_abandon: bool = True
                   ) -> tuple[int | None, int | None] | None:  # fmt: skip
        """One streamed turn; appends the reply to ``messages``.  Returns (predicted,
        cached) tokens when the turn completed, else ``None``."""
        r = self._report
        r.sent += 1
        body = {"model": self._model, "messages": messages, "max_tokens": 16, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        abandon = may_abandon and self._rng.random() < self._abandon
        try:
            async with self._http.post(self._url + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    r.failed += 1
                    r.failures.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    return None
                pred = resp.headers.get("x-kvroute-predicted-cached-tokens")
                reply, cached, error = await self._read(resp, abandon)
        except (aiohttp.ClientError, TimeoutError) as exc:
            r.failed += 1
            r.failures.append(f"{type(exc).__name__}: {exc}"[:200])
            return None
        if abandon:
            r.abandoned += 1
            return None
        if error:
            r.mid_stream_errors += 1
            return None
        r.completed += 1
        messages.append({"role": "assistant", "content": reply or "ok"})
        return (int(pred) if pred is not None else None), cached

    async def settle(self, messages: list[dict[str, str]], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the router's dry-run prediction for these
        messages stops changing: the last turn's KV events have been applied."""
        body = {"model": self._model, "messages": messages, "max_tokens": 16}
        loop = asyncio.get_running_loop()
        deadline, last = loop.time() + timeout_s, None
        while loop.time() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self._http.post(self._url + "/debug/route", json=body) as resp:
                    now = (await resp.json()).get("predicted_cached_tokens")
                if now is not None and now == last:
                    return
                last = now
            await asyncio.sleep(0.5)

    @staticmethod
    async def _read(resp: aiohttp.ClientResponse, abandon: bool
                    ) -> tuple[str, int | None, bool]:  # fmt: skip
        reply, cached, error = "", None, False
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if abandon:
                break  # the client goes away mid-stream
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = True
                continue
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices", []):
                reply += (choice.get("delta") or {}).get("content") or ""
        return reply, cached, error


def _system(n: int) -> dict[str, str]:
    return {"role": "system", "content": f"You are assistant {n}. " + " ".join(
        f"Rule {i}: answer about topic {n} carefully." for i in range(40))}


async def _converse(client: _Client, n: int, stop: asyncio.Event, rng: random.Random) -> None:
    for conv in itertools.count():
        messages = [_system(n * 1000 + conv)]
        for t in range(rng.randint(3, 6)):
            if stop.is_set():
                return
            messages.append({"role": "user", "content": f"Question {t}: " + "why " * (4 + t)})
            if await client.turn(messages) is None:
                messages.pop()  # retry the conversation's next turn from here
            await asyncio.sleep(rng.uniform(0.05, 0.3))


async def _faults(fleet: SoakFleet, spec: SoakSpec, report: SoakReport, stop: asyncio.Event
                  ) -> None:  # fmt: skip
    n = len(fleet.replicas)
    for k in itertools.count():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), spec.fault_interval_s)
        if stop.is_set():
            return
        kind, victim = spec.faults[k % len(spec.faults)], k % n
        if kind == "replica_kill":
            await fleet.kill_replica(victim)
            await asyncio.sleep(3.0)
            await fleet.start_replica(victim)
        elif kind == "events_dropped":
            await fleet.replica_faults(victim, drop_events=3)
        elif kind == "redis_kill":
            await fleet.kill_redis()
            await asyncio.sleep(2.0)
            await fleet.start_redis()
        elif kind == "events_corrupted":
            await fleet.replica_faults(victim, corrupt_events=2)
        else:
            await fleet.flush_redis()
        report.faults[kind] = report.faults.get(kind, 0) + 1


async def _sample(pid: int, report: SoakReport, t0: float, interval: float,
                  stop: asyncio.Event) -> None:  # fmt: skip
    while True:
        rss_kib = 0.0
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib = float(line.split()[1])
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        report.samples.append({"t": round(time.monotonic() - t0, 1),
                               "rss_mib": round(rss_kib / 1024, 1), "open_fds": fds,
                               "sent": report.sent})  # fmt: skip
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


async def _recovered(http: aiohttp.ClientSession, url: str, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(url + "/ready") as resp:
                kv = (await resp.json()).get("kv_events", {})
            if kv.get("ok") and kv.get("sources") and set(kv["sources"].values()) == {"live"}:
                return time.monotonic() - t0
        await asyncio.sleep(0.5)
    return None


async def _check_predictions(client: _Client, spec: SoakSpec, report: SoakReport) -> None:
    """Fresh conversations after recovery: are later turns predicted exactly?"""
    for c in range(spec.recovery_conversations):
        messages = [_system(10**6 + c)]
        for t in range(3):
            await asyncio.sleep(spec.recovery_pause_s)
            messages.append({"role": "user", "content": f"Follow-up {t}: " + "how " * (4 + t)})
            if t:
                await client.settle(messages, spec.settle_timeout_s)
            got = await client.turn(messages, may_abandon=False)
            if got is None:
                messages.pop()
                continue
            predicted, cached = got
            if t == 0 or cached is None:
                continue
            report.recovery_turns.append((predicted, cached))
            report.checked_after_recovery += 1
            report.exact_after_recovery += int((predicted or 0) == cached)
            report.over_after_recovery += int((predicted or 0) > cached)


async def _failovers(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("router_failovers_total{")))  # fmt: skip


async def run_soak(spec: SoakSpec, say: Callable[[str], None] = lambda _: None) -> SoakReport:
    """Run the soak (see the module docstring) and return its report."""
    report = SoakReport()
    rng = random.Random(spec.seed)
    fleet = SoakFleet(spec.fleet)
    try:
        await fleet.start()
        say(f"soak: router {fleet.router_url}, {len(fleet.replicas)} replicas, Redis "
            f"{fleet.redis_url}, {spec.duration_s:g} s")  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=120.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            client = _Client(http, fleet.router_url, spec.fleet.model, report, rng,
                             spec.abandon_share)  # fmt: skip
            stop, sampled = asyncio.Event(), asyncio.Event()
            t0 = time.monotonic()
            sampler = asyncio.create_task(
                _sample(fleet.router_pid, report, t0, spec.sample_interval_s, sampled))
            async with asyncio.TaskGroup() as tg:
                for n in range(spec.conversations):
                    tg.create_task(_converse(client, n, stop, random.Random(rng.random())))
                tg.create_task(_faults(fleet, spec, report, stop))
                await asyncio.sleep(spec.duration_s)
                stop.set()
            say(f"soak: faults over after {time.monotonic() - t0:.0f} s: {report.faults}")
            report.recovered_after_s = await _recovered(http, fleet.router_url,
                                                        spec.recovery_timeout_s)  # fmt: skip
            await _check_predictions(client, spec, report)
            report.failed_over = await _failovers(http, fleet.router_url)
            sampled.set()
            await sampler
            report.duration_s = round(time.monotonic() - t0, 1)
    finally:
        await fleet.aclose_children()
        text = fleet.router.tail(10**7)
        report.unhandled_exceptions = text.count("Traceback")
        fleet.cleanup()
    report.failures = [f"{n}x {msg}" for msg, n in Counter(report.failures).most_common(10)]
    return report


def register(bench: argparse._SubParsersAction[Any]) -> None:
    """``kvroute bench soak`` (added to ``kvroute bench`` by ``bench.cli``)."""
    p = bench.add_parser(
        "soak", help="a fault soak: traffic through a router while replicas, Redis and "
        "event streams break; exits 1 if a request was lost",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic under faults")
    p.add_argument("--replicas", type=int, default=3, help="simulated replicas")
    p.add_argument("--conversations", type=int, default=6, help="concurrent conversations")
    p.add_argument("--fault-interval", type=float, default=10.0, help="seconds between faults")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory (default: build the tiny one in --out)")
    p.add_argument("--out", type=Path, default=Path("kvroute-soak-out"),
                   help="where soak.json and the processes' logs go")
    p.add_argument("--faults", default=",".join(FAULTS), help="the faults injected, in turn")
    p.add_argument("--seed", type=int, default=0, help="seeds the clients' choices")
    p.add_argument("--default-memory", action="store_true",
                   help="keep the router's default memory budgets (~200 MB of prompt memos "
                   "per model, 64 MiB of sessions: they take many minutes to fill, so RSS "
                   "rises through the soak without a leak) instead of the soak's ~11 MB "
                   "(bench.soak_fleet.SOAK_MEMORY)")  # fmt: skip


async def main(args: argparse.Namespace, say: Callable[[str], None]) -> SoakReport:
    """Run the soak the parsed arguments describe; write ``soak.json`` under ``--out``."""
    from bench.fleet import build_tokenizer_dir

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or await build_tokenizer_dir(out / "tokenizer")
    spec = SoakSpec(
        SoakFleetSpec(tokenizer, replicas=args.replicas, log_dir=out / "logs",
                      memory=None if args.default_memory else SOAK_MEMORY),
        duration_s=args.duration, conversations=args.conversations,
        fault_interval_s=args.fault_interval, seed=args.seed, faults=_faults_arg(args.faults),
    )  # fmt: skip
    report = await run_soak(spec, say=say)
    (out / "soak.json").write_text(report.to_json())
    return report


def _faults_arg(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise SystemExit(f"kvroute bench soak: --faults takes some of {', '.join(FAULTS)}")
    return kinds


def passed(report: SoakReport) -> bool:
    """No request lost, no unhandled exception, and the index recovered."""
    return (
        report.failed == 0
        and report.unhandled_exceptions == 0
        and report.recovered_after_s is not None
        and report.over_after_recovery == 0
    )
