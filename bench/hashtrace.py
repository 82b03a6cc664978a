"""Import block-hash traces (the aiperf / Dynamo / Mooncake JSONL format) as workloads.

A line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354],
     "session_id": "c12", "delay": 1500}

* ``timestamp``: arrival in milliseconds from the start of the trace.
* ``input_length``, ``output_length``: prompt and reply lengths in tokens.
* ``hash_ids``: one id per ``source_block_tokens`` (512) tokens of the prompt; equal ids
  at the same position mean the same prefix (the trace's content is not published).
* ``session_id`` (optional): the conversation; ``delay`` (optional, ms): the pause after
  the previous turn of the session ended.

Scaling (``HashScale``), so a production trace fits a small simulated fleet:

* **Block size**: every hash id becomes ``block_tokens`` deterministic tokens (equal ids,
  equal tokens; ``block_tokens`` must be a multiple of the replicas' block size so the
  trace's blocks fall exactly on the replicas' blocks).  Prompt and reply lengths are
  scaled by ``block_tokens / source_block_tokens``: a prompt keeps its number of blocks,
  its last (partial) block keeps its share.
* **Time**: timestamps and delays are divided by ``time_compression``; by default the
  same factor as the tokens (``source_block_tokens / block_tokens``), so the trace's
  prompt tokens per second are preserved and a replica's load matches the original's.
* **Window**: ``start_s`` and ``duration_s`` pick a slice of the original trace (in the
  trace's own seconds); times restart at 0.

Sessions: lines with ``session_id`` keep it; a later turn is sent ``delay`` (scaled)
after the previous turn's reply ends.  Without ``session_id`` (the Mooncake traces) a
request continues the conversation of the most recent earlier request it shares the
longest run of at least ``link_blocks`` leading hash ids with (the first block is a
system prompt every request shares, hence two), and its think time is the gap since
that request's arrival.  Either way the result is ``bench.trace`` semantics: turn N+1
goes out ``think_s`` after turn N's reply, so a slow system delays the conversation.

Each imported request is a ``ScaledRequest``; ``to_trace`` renders them as chat turns for
the HTTP runner (one user message of words, one word per token: ``single_token_words``
picks words the replicas' tokenizer encodes as one token each, so lengths are exact; the
chat template adds a constant header, so block boundaries shift by the same offset for
every request), and ``token_ids`` gives the exact token ids for replays that skip the
tokenizer (``kvroute replay``).
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.trace import TraceRequest

__all__ = [
    "HashRecord",
    "HashScale",
    "ScaledRequest",
    "block_token_ids",
    "import_records",
    "load_hash_trace",
    "parse_hash_trace",
    "single_token_words",
    "to_trace",
    "token_ids",
]


@dataclass(frozen=True, slots=True)
class HashRecord:
    """One line of a block-hash trace (see the module docstring)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    delay_ms: float | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> HashRecord:
        """Parse one line's object; missing or negative fields raise ``ValueError``."""
        try:
            rec = cls(
                timestamp_ms=float(obj.get("timestamp", 0.0)),
                input_length=int(obj["input_length"]),
                output_length=int(obj.get("output_length", 1)),
                hash_ids=tuple(int(h) for h in obj.get("hash_ids") or ()),
                session_id=None if obj.get("session_id") is None else str(obj["session_id"]),
                delay_ms=None if obj.get("delay") is None else float(obj["delay"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad hash-trace line {dict(obj)!r}: {exc!r}") from exc
        if rec.timestamp_ms < 0 or rec.input_length < 1 or rec.output_length < 0:
            raise ValueError(f"bad hash-trace line {dict(obj)!r}: negative or empty")
        return rec


def parse_hash_trace(text: str) -> list[HashRecord]:
    """Parse JSONL text (blank lines skipped); errors name the line number."""
    out: list[HashRecord] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(HashRecord.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"hash trace line {n}: {exc}") from exc
    return out


def load_hash_trace(path: Path) -> list[HashRecord]:
    """Read a block-hash JSONL trace."""
    return parse_hash_trace(path.read_text(encoding="utf-8"))


@dataclass(frozen=True, slots=True)
class HashScale:
    """How a block-hash trace is scaled to the fleet (see the module docstring)."""

    block_tokens: int = 64
    """Tokens each hash id becomes (a multiple of the replicas' block size)."""
    source_block_tokens: int = 512
    """Tokens per hash id in the source trace (512 for Mooncake and aiperf)."""
    time_compression: float | None = None
    """Trace seconds per replayed second; ``None``: ``source_block_tokens /
    block_tokens`` (prompt tokens per second preserved)."""
    start_s: float = 0.0
    duration_s: float | None = None
    link_blocks: int = 2
    """Leading hash ids two requests must share to be one conversation (traces without
    ``session_id``)."""

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.source_block_tokens < 1 or self.link_blocks < 1:
            raise ValueError("block_tokens, source_block_tokens and link_blocks must be >= 1")
        if self.time_compression is not None and self.time_compression <= 0:
            raise ValueError("time_compression must be > 0")

    @property
    def token_ratio(self) -> float:
        """Replayed tokens per source token."""
        return self.block_tokens / self.source_block_tokens

    @property
    def compression(self) -> float:
        """The time compression in effect."""
        if self.time_compression is not None:
            return self.time_compression
        return self.source_block_tokens / self.block_tokens


@dataclass(frozen=True, slots=True)
class ScaledRequest:
    """One imported request, scaled: ``bench.trace`` turn semantics plus its blocks."""

    session: str
    turn: int
    at: float
    """Seconds from the start of the replay (nominal for later turns)."""
    think_s: float
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


def _scaled_prompt(rec: HashRecord, scale: HashScale) -> int:
    n_blocks = len(rec.hash_ids)
    n = max(1, round(rec.input_length * scale.token_ratio))
    if n_blocks:
        n = min(max(n, (n_blocks - 1) * scale.block_tokens + 1), n_blocks * scale.block_tokens)
    return n


def import_records(records: Iterable[HashRecord], scale: HashScale) -> list[ScaledRequest]:
    """Window, scale and group ``records`` into conversations (module docstring)."""
    t_lo = scale.start_s * 1000.0
    t_hi = None if scale.duration_s is None else t_lo + scale.duration_s * 1000.0
    chosen = sorted(
        (r for r in records if r.timestamp_ms >= t_lo and (t_hi is None or r.timestamp_ms < t_hi)),
        key=lambda r: r.timestamp_ms,
    )
    k = scale.compression
    prefix_owner: dict[int, str] = {}
    last: dict[str, tuple[int, float]] = {}  # session -> (turn, at in trace seconds)
    out: list[ScaledRequest] = []
    fresh = 0
    for rec in chosen:
        at = (rec.timestamp_ms - t_lo) / 1000.0
        session = rec.session_id
        chain: list[int] = []
        if session is None:
            h = 0
            for hid in rec.hash_ids:
                h = hash((h, hid))
                chain.append(h)
            session = next(
                (prefix_owner[c] for c in reversed(chain[scale.link_blocks - 1 :])
                 if c in prefix_owner), None)
            if session is None:
                session = f"h{fresh:06d}"
                fresh += 1
        prev = last.get(session)
        if prev is None:
            turn, think = 1, 0.0
        elif rec.delay_ms is not None:
            turn, think = prev[0] + 1, rec.delay_ms / 1000.0
        else:
            turn, think = prev[0] + 1, max(0.0, at - prev[1])
        last[session] = (turn, at)
        for c in chain[scale.link_blocks - 1 :]:
            prefix_owner[c] = session
        out.append(ScaledRequest(
            session=session, turn=turn, at=round(at / k, 6), think_s=round(think / k, 6),
            hash_ids=rec.hash_ids, prompt_tokens=_scaled_prompt(rec, scale),
            output_tokens=max(1, round(rec.output_length * scale.token_ratio)),
        ))
    return out


def block_token_ids(hash_id: int, n: int, vocab_size: int, *, offset: int = 1) -> list[int]:
    """The ``n`` tokens hash id ``hash_id`` stands for: ids in ``[offset, offset +
    vocab_size)``, a deterministic function of ``hash_id`` alone."""
    rng = random.Random(hash_id * 0x9E3779B1 + 0x7F4A7C15)
    return [offset + rng.randrange(vocab_size) for _ in range(n)]


def token_ids(
    req: ScaledRequest, scale: HashScale, vocab_size: int, *, offset: int = 1
) -> list[int]:
    """The prompt of ``req`` as token ids: its hash ids' blocks, cut to its length."""
    out: list[int] = []
    for hid in req.hash_ids:
        out.extend(block_token_ids(hid, scale.block_tokens, vocab_size, offset=offset))
        if len(out) >= req.prompt_tokens:
            break
    if len(out) < req.prompt_tokens:  # a line without hash ids: unique content
        seed = zlib.crc32(f"{req.session}/{req.turn}".encode())  # stable across runs
        out.extend(block_token_ids(seed, req.prompt_tokens - len(out), vocab_size,
                                   offset=offset))
    return out[: req.prompt_tokens]


def single_token_words(tokenizer_dir: Path, limit: int = 2000) -> list[str]:
    """Words that ``tokenizer_dir``'s tokenizer encodes as exactly one token each after a
    space (so an imported prompt of ``n`` words is ``n`` tokens), in id order, at most
    ``limit`` (blocking: it loads the tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out: list[str] = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        word = text.strip()
        if not (text.startswith(" ") and word.isalpha() and word.isascii() and len(word) > 1):
            continue
        if tok.encode(" " + word, add_special_tokens=False).ids == [i]:
            out.append(word)
            if len(out) >= limit:
                break
    return out


def to_trace(
    requests: Sequence[ScaledRequest], scale: HashScale, words: Sequence[str],
    *, model: str | None = None,
) -> list[TraceRequest]:
    """Chat turns for the HTTP runner: each token becomes one of ``words``; each turn
    sends its whole prompt as one user message (``TraceRequest.messages``)."""
    out: list[TraceRequest] = []
    for r in requests:
        ids = token_ids(r, scale, len(words), offset=0)
        text = " ".join(words[i] for i in ids)
        out.append(TraceRequest(
            session=r.session, turn=r.turn, at=r.at, think_s=r.think_s, user="",
            max_tokens=r.output_tokens, model=model,
            messages=({"role": "user", "content": text},),
        ))
    return out
