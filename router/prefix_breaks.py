"""Prefix-break detection: the cache misses clients cause themselves.

A conversation caches well only if each turn's rendered prompt is an append-only
extension of the previous one.  When a later prompt of a session is not, every block
after the first differing token is recomputed, on whichever replica.  This module finds
where two prompts of one session diverge and names the likely cause:

* ``message_edited``: a message that was in the previous request changed (a timestamp
  or random id in the system prompt, an edited history, stripped reasoning content);
* ``messages_dropped``: the new request has fewer messages (context truncation,
  summarisation);
* ``tools_changed``: the ``tools`` list changed (reordering included);
* ``options_changed``: rendering options changed (``chat_template_kwargs``,
  ``add_generation_prompt``, ``documents``, ``reasoning_effort`` ...);
* ``template``: the same messages and options rendered differently (the template
  itself is not append-only, e.g. it drops earlier reasoning);
* ``prompt_changed``: a completions prompt that does not extend the previous one.

The detector keeps, per session, only compact digests plus the token ids of the last
prompt (4 bytes per token, bounded by the session table that owns them).  Comparing is
a C-level ``bytes.startswith`` on the hot path; the divergence position is only searched
(by bisection over views) when a break is found.  Pure: no clock, no logging.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash

from prompt.token_ids import TokenIds

__all__ = [
    "BreakCause",
    "PrefixBreak",
    "PromptShape",
    "detect_break",
    "divergence",
    "pack_tokens",
    "prompt_shape",
]

BreakCause = Literal[
    "message_edited",
    "messages_dropped",
    "tools_changed",
    "options_changed",
    "template",
    "prompt_changed",
]

_OPTION_FIELDS = (
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "chat_template",
    "cache_salt",
)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as 4-byte unsigned ints (the form sessions keep)."""
    if isinstance(tokens, TokenIds):
        return tokens.to_bytes()
    return array("I", tokens).tobytes()


def divergence(previous: bytes, new: bytes) -> int | None:
    """First token index where ``new`` stops extending ``previous`` (``None`` when
    ``new`` starts with all of ``previous``)."""
    if new.startswith(previous):
        return None
    lo, hi = 0, min(len(previous), len(new)) // 4
    # Invariant: the first ``lo`` tokens agree; some token before ``hi`` differs or
    # ``new`` ends at ``hi``.  So only tokens ``lo`` to ``mid`` need comparing, in place:
    # ``startswith`` at an offset, with a view of ``previous`` (slices would copy them).
    view = memoryview(previous)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if new.startswith(view[4 * lo : 4 * mid], 4 * lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _digest(value: Any) -> int:
    try:
        raw = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        raw = repr(value).encode()
    return xxhash.xxh3_64_intdigest(raw)


@dataclass(frozen=True, slots=True)
class PromptShape:
    """Digests of what shapes a rendered prompt, per message and per option group."""

    messages: tuple[int, ...]
    roles: tuple[str, ...]
    tools: int
    options: int
    is_chat: bool


def prompt_shape(body: Mapping[str, Any] | None) -> PromptShape:
    """The digests of a request body (chat or completions)."""
    if body is None:
        return PromptShape((), (), 0, 0, False)
    messages = body.get("messages")
    if isinstance(messages, list):
        digests = tuple(_digest(m) for m in messages)
        # ``type(m) is dict`` first: an ABC check per message cost more than its digest.
        roles = tuple([str(m.get("role", "")) if type(m) is dict or isinstance(m, Mapping)
                       else "" for m in messages])
        is_chat = True
    else:
        digests, roles, is_chat = (), (), False
    options = {k: body[k] for k in _OPTION_FIELDS if k in body}
    return PromptShape(digests, roles, _digest(body.get("tools")), _digest(options), is_chat)


@dataclass(frozen=True, slots=True)
class PrefixBreak:
    """Where and (likely) why a session's new prompt stopped extending its last one."""

    position: int
    """Token index of the first difference."""
    previous_tokens: int
    new_tokens: int
    cause: BreakCause
    message_index: int | None
    """Index of the message the break falls in (or the first changed message)."""
    message_role: str | None
    lost_tokens: int
    """Tokens of the previous prompt after the break: cache the client threw away."""


def detect_break(
    previous_tokens: bytes,
    previous_shape: PromptShape,
    new_tokens: bytes,
    new_shape: PromptShape,
    *,
    message_offsets: Sequence[int] | None = None,
) -> PrefixBreak | None:
    """Compare a session's new prompt with its previous one; ``None`` if append-only.

    ``message_offsets`` (token index where each message of the new prompt starts), when
    the renderer provides them, locates the break exactly; otherwise the first message
    whose digest changed is named."""
    pos = divergence(previous_tokens, new_tokens)
    if pos is None:
        return None
    prev_n, new_n = len(previous_tokens) // 4, len(new_tokens) // 4
    cause: BreakCause
    index: int | None = None
    if not new_shape.is_chat:
        cause = "prompt_changed"
    else:
        prev_m, new_m = previous_shape.messages, new_shape.messages
        changed = next(
            (i for i, (a, b) in enumerate(zip(prev_m, new_m, strict=False)) if a != b), None
        )
        if changed is not None:
            cause, index = "message_edited", changed
        elif len(new_m) < len(prev_m):
            cause, index = "messages_dropped", len(new_m)
        elif previous_shape.tools != new_shape.tools:
            cause = "tools_changed"
        elif previous_shape.options != new_shape.options:
            cause = "options_changed"
        else:
            cause = "template"
    if message_offsets:
        located = _message_at(pos, message_offsets)
        if located is not None:
            index = located
    role = None
    if index is not None:
        roles = new_shape.roles if index < len(new_shape.roles) else previous_shape.roles
        role = roles[index] if index < len(roles) else None
    return PrefixBreak(
        position=pos,
        previous_tokens=prev_n,
        new_tokens=new_n,
        cause=cause,
        message_index=index,
        message_role=role,
        lost_tokens=prev_n - pos,
    )


def _message_at(position: int, offsets: Sequence[int]) -> int | None:
    found = None
    for i, start in enumerate(offsets):
        if start <= position:
            found = i
        else:
            break
    return found
