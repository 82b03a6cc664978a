"""Many simulated replicas in one process, and the engine-core load generator.

``python -m replica.sim.fleet serve --replicas N --tokenizer DIR [...]`` runs N
``SimServer``s on one event loop (free loopback ports) and prints one JSON line per
replica (``url``, ``kv_events_endpoint``, ``replay_endpoint``), then ``{"ready": true}``;
it serves until stdin closes or SIGTERM.

``python -m replica.sim.fleet core --replicas N --rate R --seconds S [...]`` measures the
engine core without HTTP: N ``SimEngine``s on one loop at the given time scale, each
offered an open-loop Poisson-free (evenly spaced) stream of R requests per wall second
for S seconds; prints one JSON object (completed requests per replica per wall second,
CPU seconds, TTFT percentiles in wall seconds, and the step lag).  ``--virtual`` instead
runs one engine in virtual time as fast as the CPU allows (its capacity).

The benchmark (``bench/sim_fleet_bench.py``) drives these as subprocesses, so ``bench``
never imports ``replica``; ``python -m replica.sim.fleet tokenizer --out DIR`` builds the
tiny test tokenizer for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
import time
from typing import Any

import orjson

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.scheduler import SimRequest


def _workload(seed: int, prefix_len: int, suffix_len: int, vocab: int) -> list[list[int]]:
    """A pool of prompts sharing ``prefix_len`` tokens (a system prompt)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_len)] for _ in range(64)]


async def core_realtime(args: argparse.Namespace) -> dict[str, Any]:
    """N engines on one loop, each offered ``rate`` requests per wall second."""
    vocab = list(range(1, 2000))
    engines = [
        SimEngine(EngineConfig(model="m", profile=args.profile, time_scale=args.time_scale,
                               seed=i), vocab)
        for i in range(args.replicas)
    ]
    prompts = [_workload(i, args.prefix, args.suffix, 2000) for i in range(args.replicas)]
    done = [0] * args.replicas
    ttfts: list[float] = []
    loop = asyncio.get_running_loop()

    def make_cb(i: int) -> Any:
        def cb(req: SimRequest) -> None:
            done[i] += 1
            if req.first_token_s is not None:
                ttfts.append(req.first_token_s - req.arrival_s)
        return cb

    callbacks = [make_cb(i) for i in range(args.replicas)]
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(e.run()) for e in engines]
        cpu0 = time.process_time()
        t0 = loop.time()
        sent = 0
        total = int(args.rate * args.seconds)
        tick = 0.005
        while sent < total:
            now = loop.time()
            due = min(total, int((now - t0) * args.rate) + 1)
            for k in range(sent, due):
                for i, eng in enumerate(engines):
                    prompt = prompts[i][k % 64]
                    req = SimRequest(
                        f"{i}-{k}", prompt, args.max_tokens,
                        keys=eng.scheduler.make_keys(prompt, cache_salt=None, lora_name=None),
                        seed=k, on_output=callbacks[i], stream=False,
                    )
                    eng.submit(req)
            sent = due
            await asyncio.sleep(tick)
        offered_wall = loop.time() - t0
        deadline = loop.time() + args.seconds * 2 + 5
        while sum(done) < total * args.replicas and loop.time() < deadline:
            await asyncio.sleep(0.01)
        wall = loop.time() - t0
        cpu = time.process_time() - cpu0
        for t in tasks:
            t.cancel()
    ttfts.sort()

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")

    return {
        "mode": "core-realtime",
        "replicas": args.replicas,
        "offered_per_replica_per_s": args.rate,
        "offered_seconds": round(offered_wall, 3),
        "wall_seconds": round(wall, 3),
        "completed": sum(done),
        "expected": total * args.replicas,
        "completed_per_replica_per_wall_s": round(min(done) / offered_wall, 1),
        "drain_s": round(wall - offered_wall, 3),
        "kept_up": sum(done) == total * args.replicas and wall - offered_wall < 1.0,
        "cpu_seconds": round(cpu, 3),
        "cpu_util": round(cpu / wall, 3),
        "ttft_p50_sim_s": round(pct(0.5), 4),
        "ttft_p99_sim_s": round(pct(0.99), 4),
        "steps": sum(e.steps for e in engines),
    }


def core_virtual(args: argparse.Namespace) -> dict[str, Any]:
    """One engine in virtual time: requests per wall second of CPU (its capacity)."""
    cfg = EngineConfig(model="m", profile=args.profile, time_scale=0)
    eng = SimEngine(cfg, list(range(1, 2000)))
    prompts = _workload(0, args.prefix, args.suffix, 2000)
    n = args.requests
    # Arrivals spaced evenly at args.rate simulated requests per simulated second.
    gap = 1.0 / args.rate
    sched = eng.scheduler
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    k = 0
    while k < n or sched.has_work:
        now = eng.now()
        while k < n and k * gap <= now:
            prompt = prompts[k % 64]
            sched.add(SimRequest(str(k), prompt, args.max_tokens,
                                 keys=sched.make_keys(prompt, cache_salt=None, lora_name=None),
                                 seed=k), k * gap)
            k += 1
        if not sched.has_work:
            eng.advance_virtual(k * gap)
            continue
        eng.step_virtual()
        eng.pool.take_events()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {
        "mode": "core-virtual",
        "requests": n,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "requests_per_cpu_s": round(n / cpu, 1),
        "simulated_seconds": round(eng.now(), 3),
        "steps": eng.steps,
    }


async def serve(args: argparse.Namespace) -> None:
    """Run ``--replicas`` sim servers until stdin closes or a signal arrives."""
    from replica.sim.server import SimServer, SimSettings

    servers = []
    for i in range(args.replicas):
        cfg = EngineConfig(model=args.model, profile=args.profile, time_scale=args.time_scale,
                           seed=args.seed + i, num_blocks=args.num_blocks)
        servers.append(SimServer(SimSettings(model=args.model, tokenizer=args.tokenizer,
                                             engine=cfg, topic=f"kv@sim{i}@{args.model}")))
    for s in servers:
        await s.start()
        sys.stdout.write(orjson.dumps({"url": s.url, "kv_events_endpoint": s.kv_events_endpoint,
                                       "replay_endpoint": s.replay_endpoint}).decode() + "\n")
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.read(1) else None)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(sys.stdin.fileno())
        for s in servers:
            await s.aclose()


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m replica.sim.fleet")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("core")
    c.add_argument("--replicas", type=int, default=16)
    c.add_argument("--rate", type=float, default=500.0)
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--requests", type=int, default=20_000)
    c.add_argument("--virtual", action="store_true")
    c.add_argument("--time-scale", type=float, default=1.0)
    c.add_argument("--profile", default="default")
    c.add_argument("--prefix", type=int, default=96)
    c.add_argument("--suffix", type=int, default=32)
    c.add_argument("--max-tokens", type=int, default=8)
    t = sub.add_parser("tokenizer")
    t.add_argument("--out", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--replicas", type=int, default=8)
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--model", default="sim-model")
    s.add_argument("--profile", default="default")
    s.add_argument("--time-scale", type=float, default=1.0)
    s.add_argument("--num-blocks", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import uvloop
        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    if args.cmd == "tokenizer":
        from replica.vllm.tiny_tokenizer import build_tokenizer

        sys.stdout.write(str(build_tokenizer(args.out, template="llama3")) + "\n")
        return 0
    if args.cmd == "core":
        result = core_virtual(args) if args.virtual else runner(core_realtime(args))
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        runner(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
