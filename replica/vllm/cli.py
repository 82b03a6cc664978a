"""``kvroute replica ...``: launch a real vLLM replica, build the tiny test model.

* ``kvroute replica vllm --model PATH --served-model-name NAME --port P [...] [-- ARGS]``
  prints the replica's entry for the router config (YAML) and the command line, then
  ``exec``s vLLM (or stops there with ``--dry-run``).
* ``kvroute replica tiny-model --out DIR [--template llama3|chatml]`` writes the tiny
  random Llama with its locally trained tokenizer.

Handlers import their modules lazily so ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_REPO_VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def default_vllm_python() -> str:
    """The repository's ``.venv-vllm`` interpreter when it exists, else ``python3``."""
    return str(_REPO_VENV_PYTHON) if _REPO_VENV_PYTHON.exists() else "python3"


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/kfd").exists()


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvroute replica {vllm,tiny-model}`` to the ``kvroute`` parser."""
    rep = sub.add_parser("replica", help="real vLLM replicas and the tiny test model")
    rsub = rep.add_subparsers(dest="replica_command", metavar="KIND", required=True)

    v = rsub.add_parser(
        "vllm",
        help="launch a vLLM replica with the flags kvroute needs",
        description="Launch vLLM with prefix caching, prompt-token details and KV events; "
        "print the replica entry for the router config. Arguments after -- go to vLLM.",
    )
    v.add_argument("--model", required=True, help="model directory or id")
    v.add_argument("--served-model-name", required=True)
    v.add_argument("--port", type=int, required=True, help="HTTP port")
    v.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    v.add_argument("--id", dest="replica_id", default=None, help="replica id (host:port)")
    v.add_argument("--advertise-host", default=None, help="host the router dials")
    v.add_argument("--block-size", type=int, default=None, help="tokens per KV block (32)")
    v.add_argument("--kv-events-port", type=int, default=5557, help="PUB port, bound on *")
    v.add_argument("--replay-port", type=int, default=5558, help="replay ROUTER port")
    v.add_argument(
        "--kv-events-endpoint", default=None, help="PUB endpoint (overrides --kv-events-port)"
    )
    v.add_argument(
        "--replay-endpoint", default=None, help="replay endpoint (overrides --replay-port)"
    )
    v.add_argument("--topic", default="", help="event topic (kv@<id>@<model>)")
    v.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="pool size in blocks, including vLLM's null block",
    )
    v.add_argument("--max-model-len", type=int, default=None)
    cpu = v.add_mutually_exclusive_group()
    cpu.add_argument("--cpu", dest="cpu", action="store_true", default=None,
                     help="CPU build settings (default: when no GPU is found)")
    cpu.add_argument("--gpu", dest="cpu", action="store_false")
    v.add_argument("--cpu-kvcache-gib", type=int, default=1)
    v.add_argument("--dtype", default=None,
                   help="vLLM's --dtype (default: float32 on the CPU build, else vLLM's choice)")
    v.add_argument("--dev-mode", action="store_true", help="VLLM_SERVER_DEV_MODE=1")
    v.add_argument("--python", default=None, help="interpreter with vLLM installed")
    v.add_argument("--dry-run", action="store_true", help="print, do not start")
    v.add_argument("extra", nargs=argparse.REMAINDER, help="-- then vLLM arguments")
    v.set_defaults(func=_run_vllm)

    t = rsub.add_parser("tiny-model", help="write the tiny random Llama + tokenizer")
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--template", choices=("llama3", "chatml"), default="llama3")
    t.add_argument("--vocab-size", type=int, default=2000)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_run_tiny_model)


def spec_from_args(args: argparse.Namespace) -> Any:
    """The ``VllmReplicaSpec`` the parsed ``kvroute replica vllm`` arguments describe."""
    from replica.vllm.launcher import DEFAULT_BLOCK_SIZE, VllmReplicaSpec

    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return VllmReplicaSpec(
        model=args.model,
        served_model_name=args.served_model_name,
        port=args.port,
        host=args.host,
        replica_id=args.replica_id,
        block_size=args.block_size or DEFAULT_BLOCK_SIZE,
        kv_events_endpoint=args.kv_events_endpoint or f"tcp://*:{args.kv_events_port}",
        replay_endpoint=args.replay_endpoint or f"tcp://*:{args.replay_port}",
        topic=args.topic,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        cpu=(not _has_gpu()) if args.cpu is None else args.cpu,
        cpu_kvcache_gib=args.cpu_kvcache_gib,
        dtype=args.dtype,
        dev_mode=args.dev_mode,
        python=args.python or default_vllm_python(),
        extra_args=tuple(extra),
    )


def _run_vllm(args: argparse.Namespace) -> int:
    from replica.vllm.launcher import (
        build_command,
        exec_replica,
        replica_entry_yaml,
        shell_quote,
    )

    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"kvroute replica vllm: {exc}", file=sys.stderr)
        return 2
    print("# replica entry for the router config (under `replicas:`)")
    print(replica_entry_yaml(spec, args.advertise_host), end="")
    print("# command")
    print("# " + shell_quote(build_command(spec)))
    sys.stdout.flush()
    if args.dry_run:
        return 0
    exec_replica(spec)
    return 0  # pragma: no cover - exec does not return


def _run_tiny_model(args: argparse.Namespace) -> int:
    from replica.vllm.tiny_model import build_tiny_model

    out = build_tiny_model(
        args.out, template=args.template, vocab_size=args.vocab_size, seed=args.seed
    )
    print(out)
    return 0


__all__ = ["default_vllm_python", "register", "spec_from_args"]
