"""What the ``kv`` policy's own work costs per request, in one thread's CPU time.

``python -m tests.router.kv_route_cpu [--replicas N] [--passes P] [--repeats R] [--profile]
[--decisions]``

``bench.kv_overhead`` measures the whole router under load, on a shared machine where
its CPU figures move with the neighbours.  This measures only what the ``kv`` policy
adds to the proxy, in process and in CPU time (``time.thread_time``), so it can be
compared before and after a change of the policy's code on a busy machine:

* the router app as ``kvroute serve`` builds it (collector settings included) for
  ``bench.kv_overhead``'s settings (``scoring.models`` with the tiny test tokenizer,
  metrics, the instrumented in-memory index), started in this process; no KV event
  sources: the index is filled directly
  with the blocks each replica holds in ``bench.kv_overhead`` (conversation ``i``'s
  history on replica ``i % N``), keyed from another renderer;
* each request is one of ``bench.kv_overhead``'s bodies (32 ten-turn chats of ~25 KB,
  each ending with one of 8 fresh last user messages), parsed as the proxy parses it,
  in the order its 32 connections send them; the policy's ``route`` then ``record``
  (with the fake replica's usage) are timed together, the parsing is not.

Each repeat is ``--passes`` passes over the 32 x 8 bodies after one untimed warm pass;
it prints the median and spread of the per-request CPU over the repeats, and the load
average.  ``--profile`` runs one more repeat under ``cProfile`` and prints the top
functions by own time; ``--decisions`` prints a digest of every decision's replicas,
reason and prediction (for checking that a change routes identically).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.kv_overhead import BLOCK_SIZE, CONVERSATIONS, MODEL, TAILS, bodies, history

__all__ = ["main"]


def _settings(replicas: int, tokenizer: Path) -> Any:
    from router.config import RouterSettings

    return RouterSettings.model_validate({
        "host": "127.0.0.1", "port": 0, "log_level": "warning", "policy": "kv",
        "replicas": [{"url": f"http://127.0.0.1:{9 + i}", "id": f"r{i}", "models": [MODEL]}
                     for i in range(replicas)],
        "health": {"interval_s": 3600.0},
        "scoring": {"models": [{"name": MODEL, "block_size": BLOCK_SIZE,
                                "tokenizer": str(tokenizer)}],
                    "discover_kv_events": False, "scrape": {"enabled": False}},
    })


async def _fill(index: Any, replicas: int, tokenizer: Path) -> None:
    """Each replica's conversations, as ``bench.kv_overhead``'s replicas publish them."""
    from kvkeys.types import EngineKey, ReplicaId
    from prompt.registry import ModelSpec, RendererRegistry

    registry = RendererRegistry([ModelSpec(name=MODEL, block_size=BLOCK_SIZE,
                                           tokenizer=str(tokenizer))])
    engine_key = 1
    for c in range(CONVERSATIONS):
        keys = registry.render_chat(history(c)).block_keys
        engine = [EngineKey(engine_key + i) for i in range(len(keys))]
        engine_key += len(keys)
        await index.add(ReplicaId(f"r{c % replicas}"), engine, keys)


async def run(replicas: int, passes: int, repeats: int, profile: bool,
              decisions: bool) -> list[float]:  # fmt: skip
    """Per-request CPU seconds of ``route`` + ``record``, one figure per repeat."""
    from bench.fleet import build_tokenizer_dir
    from kvkeys.types import ReplicaId
    from router.app import create_app
    from router.policy import Receipt, RouteRequest
    from router.request import parse_body
    from router.serving import _tune_gc

    work = Path(tempfile.mkdtemp(prefix="kvroute-kv-route-cpu-"))
    tok = await build_tokenizer_dir(work / "tiny-model")
    app = create_app(_settings(replicas, tok), sighup=False)
    _tune_gc()  # the collector's settings of ``kvroute serve``
    candidates = [ReplicaId(f"r{i}") for i in range(replicas)]
    raw = [bodies(c) for c in range(CONVERSATIONS)]
    order = [(c, (c + n) % TAILS) for n in range(TAILS) for c in range(CONVERSATIONS)]
    digest = hashlib.sha256()
    async with app.router.lifespan_context(app) as state:
        ctx = state["context"]  # type: ignore[index]
        await _fill(ctx.services["kv"].index, replicas, tok)
        policy = state["policies"].get("kv")  # type: ignore[index]
        thread_time = time.thread_time
        seq = 0

        async def one_pass(record_decisions: bool) -> float:
            nonlocal seq
            spent = 0.0
            for c, t in order:
                seq += 1
                parsed = parse_body("chat", raw[c][t])
                request = RouteRequest(f"req-{seq}", "chat", "/v1/chat/completions", MODEL,
                                       parsed, f"conv-{c}", "kv")
                t0 = thread_time()
                decision = await policy.route(request, candidates)
                policy.record(request, decision, Receipt(decision.replica, True, 6000, None,
                                                         0.001, 16))
                spent += thread_time() - t0
                if record_decisions:
                    digest.update(repr((c, t, decision.replicas, decision.reason,
                                        decision.prompt_tokens,
                                        decision.predicted_cached_tokens)).encode())
            return spent

        await one_pass(decisions)
        per_request = []
        for _ in range(repeats):
            spent = 0.0
            for _ in range(passes):
                spent += await one_pass(decisions)
            per_request.append(spent / (passes * len(order)))
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(passes):
                await one_pass(False)
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(70)
    if decisions:
        print(f"decisions digest (every timed pass): {digest.hexdigest()[:16]}")
    return per_request


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m tests.router.kv_route_cpu",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--passes", type=int, default=4, help="passes over the bodies per repeat")
    p.add_argument("--repeats", type=int, default=7, help="repeats (default 7)")
    p.add_argument("--profile", action="store_true", help="then one repeat under cProfile")
    p.add_argument("--decisions", action="store_true", help="print the decisions' digest")
    args = p.parse_args(argv)
    load = os.getloadavg()
    xs = asyncio.run(run(args.replicas, args.passes, args.repeats, args.profile,
                         args.decisions))
    us = sorted(x * 1e6 for x in xs)
    print(f"kv route+record CPU per request: median {statistics.median(us):.0f} us "
          f"(min {us[0]:.0f}, max {us[-1]:.0f}; {len(us)} repeats of "
          f"{args.passes * CONVERSATIONS * TAILS} requests); load average "
          f"{load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
