"""``kvroute probe-horizon``: the turn-2 eviction-horizon probe (``bench.horizon``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from bench.asyncio_main import run_main as _run

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvroute probe-horizon``."""
    p = sub.add_parser(
        "probe-horizon",
        help="find the pause after which a conversation's next turn misses the cache",
        description="For each pause, send a two-turn conversation with a unique nonce, "
        "wait, send turn 2, and report turn-2 TTFT and cached tokens; the pause at which "
        "they jump is the eviction horizon.  --sim starts a simulated replica to probe "
        "(with a time scale, the probe of minutes takes seconds).",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="endpoint to probe (replica or router)")
    target.add_argument("--sim", action="store_true",
                        help="probe a simulated replica started for the purpose")
    p.add_argument("--model", default=None, help="model name (required with --url)")
    p.add_argument("--pauses", default="0,10,30,60,120", help="seconds, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="probes per pause")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="turn-1 prompt size (default 1024; with --sim 512)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="wall seconds per probe second (default 1; with --sim 0.05)")
    p.add_argument("--background-rps", type=float, default=None,
                   help="background requests per second of unique prompts (default 0; "
                   "with --sim 1)")
    p.add_argument("--background-tokens", type=int, default=512,
                   help="prompt tokens of each background request")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of background load before probing (default 0; with --sim 60)")
    p.add_argument("--num-blocks", type=int, default=2048, help="--sim: KV blocks")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--json", action="store_true",
                   help="print the JSON result instead of the table")
    p.set_defaults(func=_probe)


def _probe(args: argparse.Namespace) -> int:
    from bench.horizon import ProbeConfig, Prober, format_table

    pauses = tuple(float(x) for x in args.pauses.split(",") if x.strip())

    async def go() -> Any:
        if not args.sim:
            if not args.model:
                raise SystemExit("kvroute probe-horizon: --model is required with --url")
            cfg = ProbeConfig(
                url=args.url, model=args.model, pauses=pauses, repeats=args.repeats,
                prompt_tokens=args.prompt_tokens or 1024, time_scale=args.time_scale or 1.0,
                background_rps=args.background_rps or 0.0,
                background_tokens=args.background_tokens, warmup_s=args.warmup or 0.0,
            )
            return await Prober(cfg).run()
        return await _probe_sim(args, pauses)

    try:
        result = _run(go())
    except KeyboardInterrupt:
        print("kvroute probe-horizon: interrupted", file=sys.stderr)
        return 130
    doc = json.dumps(result.to_json(), indent=2) + "\n"
    if args.json:
        sys.stdout.write(doc)
    else:
        print(format_table(result))
    if args.out is not None:
        args.out.write_text(doc)
    return 0


async def _probe_sim(args: argparse.Namespace, pauses: tuple[float, ...]) -> Any:
    import tempfile

    from bench.fleet import Fleet, FleetSpec, build_tokenizer_dir
    from bench.horizon import ProbeConfig, Prober
    from bench.workload import measure_tokens_per_word

    scale = args.time_scale or 0.05
    with tempfile.TemporaryDirectory(prefix="kvroute-probe-") as tmp:
        tok = await build_tokenizer_dir(Path(tmp) / "tiny-model")
        tpw = await asyncio.to_thread(measure_tokens_per_word, tok)
        spec = FleetSpec(tokenizer=tok, replicas=1, num_blocks=args.num_blocks,
                         time_scale=scale, router=False, log_dir=Path(tmp) / "logs")
        async with Fleet(spec) as fleet:
            cfg = ProbeConfig(
                url=fleet.url, model=spec.model, pauses=pauses, repeats=args.repeats,
                prompt_tokens=args.prompt_tokens or 512, tokens_per_word=tpw, time_scale=scale,
                sim_timing=True,
                background_rps=1.0 if args.background_rps is None else args.background_rps,
                background_tokens=args.background_tokens,
                warmup_s=60.0 if args.warmup is None else args.warmup,
            )
            return await Prober(cfg).run()
