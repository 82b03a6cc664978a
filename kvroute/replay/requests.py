"""What a replay sends: token-level turns of conversations.

A ``ReplayRequest`` is one turn with its exact prompt token ids.  Turn 1 of a session
arrives at ``at``; turn N+1 arrives ``think_s`` after turn N's last token (the
``bench.trace`` semantics, so the HTTP runner and the replay agree on the schedule).

Two sources:

* ``from_chat_trace``: a ``bench.trace`` chat trace rendered with a tokenizer directory
  and its chat template (``prompt`` renderer, exactly as the simulated replica renders
  it), the history carrying the trace's fixed replies.
* ``from_hash_trace``: an imported block-hash trace (``bench.hashtrace``): each hash id
  is ``block_tokens`` deterministic token ids, so blocks fall exactly on the replicas'
  blocks when ``block_tokens`` is a multiple of the block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.hashtrace import HashScale, ScaledRequest, import_records, load_hash_trace, token_ids
from bench.trace import TraceRequest, by_session, conversation

__all__ = ["ReplayRequest", "from_chat_trace", "from_hash_trace", "load_hash_requests"]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One turn of one conversation, tokenised."""

    session: str
    turn: int
    at: float
    think_s: float
    tokens: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None


def from_chat_trace(
    trace: Sequence[TraceRequest], tokenizer_dir: Path, *, model: str,
    max_tokens_cap: int | None = None,
) -> list[ReplayRequest]:
    """Render every turn of ``trace`` with the tokenizer's chat template."""
    from replica.sim.render import TokenizerRenderer

    renderer = TokenizerRenderer(tokenizer_dir)
    out: list[ReplayRequest] = []
    for turns in by_session(trace).values():
        for turn, messages in zip(turns, conversation(turns), strict=True):
            body = {"model": model, "messages": messages, "add_generation_prompt": True}
            ids = renderer.render_chat(body)
            cap = max_tokens_cap or turn.max_tokens
            out.append(ReplayRequest(
                session=turn.session, turn=turn.turn, at=turn.at, think_s=turn.think_s,
                tokens=tuple(ids), max_tokens=min(turn.max_tokens, cap),
                cache_salt=turn.cache_salt,
            ))
    return out


def from_hash_trace(
    requests: Sequence[ScaledRequest], scale: HashScale, vocab_size: int,
    *, max_tokens_cap: int | None = None,
) -> list[ReplayRequest]:
    """Token ids for an imported block-hash trace (ids ``1 .. vocab_size``)."""
    out = []
    for r in requests:
        cap = max_tokens_cap or r.output_tokens
        out.append(ReplayRequest(
            session=r.session, turn=r.turn, at=r.at, think_s=r.think_s,
            tokens=tuple(token_ids(r, scale, vocab_size)),
            max_tokens=min(r.output_tokens, cap),
        ))
    return out


def load_hash_requests(
    path: Path, scale: HashScale, vocab_size: int, *, max_tokens_cap: int | None = None
) -> list[ReplayRequest]:
    """``from_hash_trace`` of the block-hash trace at ``path``, windowed and scaled by
    ``scale`` (``bench.hashtrace.import_records``)."""
    return from_hash_trace(import_records(load_hash_trace(path), scale), scale, vocab_size,
                           max_tokens_cap=max_tokens_cap)
