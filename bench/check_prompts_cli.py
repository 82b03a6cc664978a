"""``kvroute check-prompts``: the append-only prompt checker (``bench.check_prompts``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvroute check-prompts``."""
    p = sub.add_parser(
        "check-prompts",
        help="check that each turn's prompt is an append-only extension of the previous",
        description="Render transcripts (JSONL: a message list per line, or objects with "
        "messages, session, tools, chat_template_kwargs, generated_token_ids) as the engine "
        "would and report, per turn, tokens, shared prefix, reusable blocks and share of "
        "the previous prompt; for turns under the threshold, the first differing token, "
        "its message and a likely cause.",
        epilog="exit status: 0 no turn flagged; 1 turns flagged (under --threshold), so it "
        "can gate a CI job; 2 unreadable input (file, JSON line, tokenizer)",
    )
    p.add_argument("transcripts", type=Path, help="transcript JSONL")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", type=Path,
                     help="model directory with tokenizer.json and a chat template")
    src.add_argument("--url", help="render with a replica's /tokenize instead (vLLM or sim)")
    p.add_argument("--model", default=None, help="model name for --url")
    p.add_argument("--generated", type=Path, default=None,
                   help="JSONL of {session, turn, token_ids}: the engine's generated ids")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block, as the replicas'")
    p.add_argument("--threshold", type=float, default=0.9,
                   help="flag turns keeping less than this share (default 0.9)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--json", action="store_true",
                   help="print the JSON report instead of the table")
    p.set_defaults(func=_check_prompts)


def _check_prompts(args: argparse.Namespace) -> int:
    from bench.chat_tokenizers import http_tokenizer, local_tokenizer
    from bench.check_prompts import (
        Checker,
        TranscriptError,
        format_table,
        load_transcripts,
        to_json,
    )

    try:
        sessions = load_transcripts(args.transcripts, args.generated)
    except TranscriptError as exc:
        print(f"kvroute check-prompts: {exc}", file=sys.stderr)
        return 2
    if args.url:
        tok = http_tokenizer(args.url, args.model)
    else:
        try:
            tok = local_tokenizer(args.tokenizer)
        except (OSError, ValueError, LookupError) as exc:
            print(f"kvroute check-prompts: --tokenizer {args.tokenizer}: {exc} (a model "
                  "directory with tokenizer.json and a chat template)", file=sys.stderr)
            return 2
    checker = Checker(tok, block_size=args.block_size, threshold=args.threshold)
    reports = [checker.check_session(turns, name) for name, turns in sessions.items()]
    doc = json.dumps(to_json(reports), indent=2) + "\n"
    if args.json:
        sys.stdout.write(doc)
    else:
        print(format_table(reports, args.block_size))
    if args.out is not None:
        args.out.write_text(doc)
    return 1 if any(r.flagged for r in reports) else 0
