"""``kvroute sim``'s process body: build a ``SimServer`` from CLI arguments and serve.

Prints one JSON line with the URL and resolved event endpoints (the replica entry for
a router config), then serves until SIGINT/SIGTERM.  A ``crash`` fault exits the process
with status 17.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import orjson

from replica.sim.engine import EngineConfig
from replica.sim.faults import Faults
from replica.sim.server import SimServer, SimSettings, exit_process


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    """Translate ``kvroute sim`` arguments into ``SimSettings``."""
    engine = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        profile=args.profile,
        time_scale=args.time_scale,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        cpu_offload_blocks=args.cpu_offload_blocks,
        cpu_offload_bandwidth=args.cpu_offload_bandwidth,
    )
    faults = Faults(
        hang=args.fault_hang,
        slow_first_token_s=args.fault_slow_first_token,
        error_status=args.fault_error_status,
        drop_events=args.fault_drop_events,
    )
    return SimSettings(
        model=args.model,
        tokenizer=args.tokenizer,
        host=args.host,
        port=args.port,
        engine=engine,
        kv_events=not args.no_kv_events,
        kv_events_endpoint=args.kv_events_endpoint,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
        legacy_encoding=args.legacy_event_encoding,
        legacy_replay=args.legacy_replay,
        enable_prompt_tokens_details=not args.no_prompt_tokens_details,
        lora_modules=tuple(args.lora_modules or ()),
        faults=faults,
    )


async def serve_forever(args: argparse.Namespace) -> int:
    """Run one simulated replica until a termination signal."""
    server = SimServer(settings_from_args(args), on_crash=exit_process)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    entry = {
        "url": server.url,
        "model": args.model,
        "block_size": args.block_size,
        "num_gpu_blocks": server.engine.pool.num_blocks,
        "kv_events_endpoint": server.kv_events_endpoint,
        "replay_endpoint": server.replay_endpoint,
        "topic": args.topic,
    }
    sys.stdout.write(orjson.dumps(entry).decode() + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await server.aclose()
    return 0
