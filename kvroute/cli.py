"""``kvroute``: one command, a subcommand per job.

Each layer registers its own subcommands, so this module is the only place that knows
them all (``router``: serve, indexer; ``replica``: sim, replica; ``bench``: demo, bench,
check-prompts, probe-horizon; ``kvroute.replay``: replay).  Handlers import their heavy
dependencies lazily so that ``kvroute --help`` stays fast.

What every subcommand shares is set here, after the layers registered theirs:

* help shows each option's default (``HelpFormatter``), unless its help already says it;
* ``--log-level`` with the same choices everywhere (added where a layer did not);
* a mistyped option is reported by the subcommand it belongs to, with its usage and the
  closest option it has (``--replicas`` -> ``--replica``);
* a handler that fails prints one line naming the error and exits 1; the traceback only
  with ``--log-level debug``.  Exit codes: 0 success, 1 failure (or, for check-prompts,
  flagged turns), 2 usage or configuration error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import bench.cli
import replica.cli
import router.cli
from kvroute import __version__
from kvroute.replay import cli as replay_cli

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""``--log-level``'s choices in every subcommand (case-insensitive)."""

_PARSER = "kvroute_parser"
_OWN_LOGGING = "kvroute_configures_logging"


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions and epilogs wrapped by paragraph, except paragraphs written on several
    lines (examples, lists), which are kept as written; each option's help ends with its
    default unless the help already mentions one (or there is none worth showing)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        return "\n\n".join(
            p if "\n" in p.strip("\n") else super(HelpFormatter, self)._fill_text(p, width, indent)
            for p in paragraphs
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "(default" in text or "default:" in text
                or action.nargs == 0
                or default is None or default is argparse.SUPPRESS or default == []):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with kvroute's help format as the default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvroute`` argument parser."""
    parser = Parser(
        prog="kvroute",
        description="A KV-cache-aware load-balancing router for fleets of vLLM replicas.",
        epilog="exit codes: 0 success; 1 failure (check-prompts: turns flagged); "
        "2 usage or configuration error; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    router.cli.register(sub)
    replica.cli.register(sub)
    bench.cli.register(sub)
    replay_cli.register(sub)
    for leaf in leaf_parsers(parser):
        _add_log_level(leaf)
        leaf.set_defaults(**{_PARSER: leaf})
    return parser


def leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser that runs a command (the subcommands without subcommands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
        return
    for action in subs:
        seen: set[int] = set()
        for child in action.choices.values():
            if id(child) not in seen:  # aliases map to the same parser
                seen.add(id(child))
                yield from leaf_parsers(child)


def _add_log_level(leaf: argparse.ArgumentParser) -> None:
    existing = next((a for a in leaf._actions if "--log-level" in a.option_strings), None)
    if existing is None:
        leaf.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning",
                          help="log level; debug also shows the traceback of a failure")
        leaf.set_defaults(**{_OWN_LOGGING: False})
        return
    # a layer's own --log-level (it configures logging itself): same choices, any case
    existing.type = str.lower
    existing.choices = LOG_LEVELS
    leaf.set_defaults(**{_OWN_LOGGING: True})


def _unknown_options(leaf: argparse.ArgumentParser, extras: Sequence[str]) -> NoReturn:
    known = [s for a in leaf._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for item in extras:
        name = item.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    leaf.error("; ".join([message, *hints]))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvroute`` script."""
    # kvroute tokenises on the event loop's thread, a piece or two per request: the
    # tokenizers library must not hand that work to its thread pool (a wake-up per call,
    # and a warning in every process forked after it).  An explicit setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    leaf: argparse.ArgumentParser = getattr(args, _PARSER)
    if extras:
        _unknown_options(leaf, extras)
    level = (getattr(args, "log_level", None) or "info").lower()
    if not getattr(args, _OWN_LOGGING, True):
        logging.basicConfig(level=level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print(f"{leaf.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if level == "debug":
            raise
        print(f"{leaf.prog}: error: {exc or type(exc).__name__} "
              "(--log-level debug shows the traceback)", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
