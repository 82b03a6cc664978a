"""Traces: the requests of a workload, one JSON object per line.

A line is one turn of one conversation::

    {"session": "s0001", "turn": 2, "at": 31.5, "think_s": 14.2, "user": "...",
     "max_tokens": 350, "reply": "...", "tenant": "t0", "cache_salt": "salt-t0-0"}

* ``session`` and ``turn`` (1-based) identify the turn; a session's turns are replayed in
  order.
* ``at`` (seconds from the start of the trace): when turn 1 is sent.  For later turns it
  is nominal; the runner sends turn N+1 ``think_s`` seconds after turn N's reply ends, so a
  slow system delays the rest of the conversation, as real users would be delayed.
* ``system`` (turn 1 only): the system prompt.  ``user``: the new user message.
* ``reply``: a fixed assistant reply for the history of the next turn, used when the
  runner is told not to use the replies the endpoint actually returns.
* ``messages`` (optional): the complete message list to send, overriding the history the
  runner would build (for transcripts captured from real applications).
* ``tenant``, ``cache_salt`` (sent as the body field vLLM reads), ``model`` are optional.

Contracts: ``save`` then ``load`` gives equal requests; keys are written sorted and absent
optional fields are omitted, so the same trace always gives the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One turn of one conversation (see the module docstring for each field)."""

    session: str
    turn: int
    at: float
    user: str
    max_tokens: int
    think_s: float = 0.0
    system: str | None = None
    reply: str | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    model: str | None = None
    messages: tuple[Message, ...] | None = None

    def __post_init__(self) -> None:
        if self.turn < 1:
            raise ValueError(f"turn must be >= 1, got {self.turn}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.at < 0 or self.think_s < 0:
            raise ValueError("at and think_s must be >= 0")

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this line (``None`` fields left out)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TraceRequest:
        """Parse one line's object; unknown keys are ignored, missing required ones raise."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in obj.items() if k in known}
        if "messages" in kwargs and kwargs["messages"] is not None:
            kwargs["messages"] = tuple(dict(m) for m in kwargs["messages"])
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad trace line {dict(obj)!r}: {exc}") from exc


def dumps(requests: Iterable[TraceRequest]) -> str:
    """The JSONL text of ``requests``."""
    return "".join(
        json.dumps(r.to_json(), sort_keys=True, ensure_ascii=False) + "\n" for r in requests
    )


def loads(text: str) -> list[TraceRequest]:
    """Parse JSONL text (blank lines skipped); errors name the line number."""
    out: list[TraceRequest] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(TraceRequest.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"trace line {n}: {exc}") from exc
    return out


def save(requests: Iterable[TraceRequest], path: Path) -> None:
    """Write ``requests`` to ``path`` as JSONL."""
    path.write_text(dumps(requests), encoding="utf-8")


def load(path: Path) -> list[TraceRequest]:
    """Read a JSONL trace."""
    return loads(path.read_text(encoding="utf-8"))


def by_session(requests: Iterable[TraceRequest]) -> dict[str, list[TraceRequest]]:
    """Each session's turns, in turn order; sessions ordered by their first ``at``."""
    groups: dict[str, list[TraceRequest]] = {}
    for r in sorted(requests, key=lambda r: (r.at, r.session, r.turn)):
        groups.setdefault(r.session, []).append(r)
    for turns in groups.values():
        turns.sort(key=lambda r: r.turn)
    return groups


def conversation(
    turns: Sequence[TraceRequest], replies: Sequence[str] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """The message list sent for each turn of one session.

    The history of turn N+1 is turn N's messages plus turn N's reply: ``replies[N-1]``
    when given (the text the endpoint returned), else the trace's fixed ``reply``.  A turn
    with explicit ``messages`` is sent as is and becomes the history.
    """
    history: list[dict[str, Any]] = []
    for i, r in enumerate(turns):
        if r.messages is not None:
            msgs = [dict(m) for m in r.messages]
        else:
            if r.system is not None and not history:
                history.append({"role": "system", "content": r.system})
            msgs = [*history, {"role": "user", "content": r.user}]
        yield msgs
        reply = replies[i] if replies is not None and i < len(replies) else (r.reply or "")
        history = [*msgs, {"role": "assistant", "content": reply}]
