"""``kvroute``: one command, a subcommand per job.

Each layer registers its own subcommands, so this module is the only place that knows
them all (``router``: serve, indexer; ``replica``: sim, replica; ``bench``: demo, bench,
check-prompts, probe-horizon; ``kvroute.replay``: replay).  Handlers import their heavy
dependencies lazily so that ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import bench.cli
import replica.cli
import router.cli
from kvroute import __version__
from kvroute.replay import cli as replay_cli


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvroute`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="A KV-cache-aware load-balancing router for fleets of vLLM replicas.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    router.cli.register(sub)
    replica.cli.register(sub)
    bench.cli.register(sub)
    replay_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvroute`` script."""
    # kvroute tokenises on the event loop's thread, a piece or two per request: the
    # tokenizers library must not hand that work to its thread pool (a wake-up per call,
    # and a warning in every process forked after it).  An explicit setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
