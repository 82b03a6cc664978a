"""``kvroute sim``'s process body: build a ``SimServer`` from CLI arguments and serve.

Prints one JSON line with the URL, model and resolved event endpoints: a replica entry
that pastes as is under a router config's ``replicas:`` (a JSON object is YAML).  The
pool's geometry goes to the log (``block_size`` belongs under ``scoring.models``).  Then
it serves until SIGINT/SIGTERM.  A ``crash`` fault exits the process
with status 17.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
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
        clock_file=args.clock_file,
    )
    faults = Faults(
        hang=args.fault_hang,
        slow_first_token_s=args.fault_slow_first_token,
        error_status=args.fault_error_status,
        drop_events=args.fault_drop_events,
        corrupt_events=args.fault_corrupt_events,
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


def replica_entry(server: SimServer, args: argparse.Namespace) -> dict[str, object]:
    """The replica's entry for a router config (``ReplicaSettings``' fields only)."""
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    entry: dict[str, object] = {"url": f"http://{host}:{server.port}", "models": [args.model]}
    for name in ("kv_events_endpoint", "replay_endpoint"):
        endpoint = getattr(server, name)
        if endpoint is not None:  # a wildcard bind is dialled on the replica's host
            for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
                endpoint = endpoint.replace(wildcard, f"tcp://{host}:")
            entry[name] = endpoint
    return entry


async def serve_forever(args: argparse.Namespace) -> int:
    """Run one simulated replica until a termination signal."""
    server = SimServer(settings_from_args(args), on_crash=exit_process)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(orjson.dumps(replica_entry(server, args)).decode() + "\n")
    sys.stdout.flush()
    logging.getLogger(__name__).info(
        "simulated replica of %s on %s: %d blocks of %d tokens (router config: "
        "scoring.models: [{name: %s, block_size: %d, tokenizer: %s}])",
        args.model, server.url, server.engine.pool.num_blocks, args.block_size,
        args.model, args.block_size, args.tokenizer)  # fmt: skip
    try:
        await stop.wait()
    finally:
        await server.aclose()
    return 0
