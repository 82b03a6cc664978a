"""Subcommands of ``kvroute`` that belong to ``replica``.

* ``kvroute sim``: a simulated vLLM V1 replica (``replica.sim.server``).
* ``kvroute replica vllm ...``: real vLLM, registered by ``replica.vllm.cli`` (see below).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from replica.vllm import cli as vllm_cli


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this layer's subcommands to the ``kvroute`` parser."""
    _register_sim(sub)
    vllm_cli.register(sub)  # `kvroute replica {vllm,tiny-model}` (H5)


def _register_sim(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "sim",
        help="run a simulated vLLM V1 replica",
        description="A simulated replica that behaves like a vLLM 0.32 server to a router: "
        "OpenAI API, prefix cache with vLLM's block semantics, KV events over ZMQ, metrics.",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port to listen on")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (as vLLM on GPU and the router's "
                   "scoring.models default)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks incl. the null block (default: from the profile)")
    p.add_argument("--profile", default="default",
                   help="timing profile: default or llama-3.1-8b-h100 (replica.sim.profiles)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per simulated second (1 = real time, 0.01 = 100x "
                   "faster, 0 = virtual time, as fast as the CPU allows)")
    p.add_argument("--clock-file", default=None,
                   help="a benchmark's shared clock offset file (aio.clock_warp): the "
                   "engine's clock moves with it while the benchmark skips idle time")
    p.add_argument("--seed", type=int, default=0, help="seeds the engine-side block hash")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, as vLLM's flag (default: from the profile)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per engine step, as vLLM's flag (default: from the profile)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus output in tokens (default: from the profile)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="ZMQ PUB endpoint (vLLM's bind/connect rule); default: a free "
                   "loopback port, see GET /kv_event_sources")
    p.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER replay endpoint")
    p.add_argument("--topic", default="", help="first frame of every event message")
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    p.add_argument("--legacy-event-encoding", action="store_true",
                   help="tagged-array events (vLLM <= 0.23) instead of 0.24+ tagged maps")
    p.add_argument("--legacy-replay", action="store_true",
                   help="replay replies without the topic frame (vLLM <= 0.24)")
    p.add_argument("--cpu-offload-blocks", type=int, default=0,
                   help="host-tier capacity in blocks (0: no CPU offload)")
    p.add_argument("--cpu-offload-bandwidth", type=float, default=25e9,
                   help="host-to-GPU bandwidth in bytes/s")
    p.add_argument("--lora-modules", nargs="*", default=None, metavar="NAME",
                   help="LoRA adapter names served besides the base model")
    p.add_argument("--no-prompt-tokens-details", action="store_true",
                   help="omit usage.prompt_tokens_details (vLLM's default without "
                   "--enable-prompt-tokens-details)")
    p.add_argument("--fault-hang", action="store_true",
                   help="fault injection: accept requests and never answer them")
    p.add_argument("--fault-slow-first-token", type=float, default=0.0, metavar="SECONDS",
                   help="fault injection: delay every first token by SECONDS")
    p.add_argument("--fault-error-status", type=int, default=None, metavar="STATUS",
                   help="fault injection: answer every completion with this HTTP status")
    p.add_argument("--fault-drop-events", type=int, default=0, metavar="N",
                   help="fault injection: drop N KV-event batches (a sequence gap)")
    p.add_argument("--fault-corrupt-events", type=int, default=0, metavar="N",
                   help="fault injection: publish the next N storing event batches with a "
                   "malformed event")
    p.add_argument("--log-level", default="info", help="log level")
    p.set_defaults(func=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    import errno
    import logging

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _serve_sim(args)
    except FileNotFoundError as exc:  # the tokenizer (prompt.tokenizer.TokenizerNotFound)
        if args.log_level == "debug":
            raise
        print(f"kvroute sim: --tokenizer {args.tokenizer}: {exc} (a directory with "
              "tokenizer.json, e.g. one written by `kvroute replica tiny-model --out DIR`)",
              file=sys.stderr)
        return 2
    except OSError as exc:
        if args.log_level == "debug" or exc.errno not in (errno.EADDRINUSE, errno.EACCES,
                                                           errno.EADDRNOTAVAIL):
            raise
        print(f"kvroute sim: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc} (another process holds the port? pick another --port)",
              file=sys.stderr)
        return 1


def _serve_sim(args: argparse.Namespace) -> int:
    import asyncio

    from replica.sim.main import serve_forever

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(serve_forever(args))
    code: int = uvloop.run(serve_forever(args))
    return code
