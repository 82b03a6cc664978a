"""Recent turns of conversations: what the next turn of each can take over.

A chat client re-sends the whole conversation on every turn, so the request of turn
N+1 starts with the messages of turn N's request (or of turn N and its reply, when the
router pre-warmed it).  ``TurnMemo`` keeps, per recently rendered conversation, one
``Turn``:

* the request's messages, to compare the next request with: for text-only messages
  (exact dicts whose values are all exact strings, the usual chat turn) a shallow copy,
  ``snapshot``; for any other messages their ``prompt.plain_data`` bytes, ``raw``;
* ``conversation``: the messages as built for the template (``prompt.chat_messages``),
  one object per message, sharing no container with the request (text-only messages
  are built into new containers; others are copied), never mutated afterwards, and
  whether one of them is a developer message;
* ``loops``: the template's message loops as rendered (``prompt.message_loop``);
* ``split``: the rendered text cut into pieces (``prompt.segments.TextSplit``);
* ``keys``: where the block-key chain stood after each piece (``prompt.keyer``).

``begin(messages, content_format)`` looks for the remembered turn whose messages are
the longest prefix of this request's, at most ``LOOKBACK`` messages shorter (the
previous turn, the pre-warmed reply, a retry), and accepts it only if those messages
are exactly equal, never by a hash: text-only messages by ``==`` (C speed; with exact
string values ``==`` is exact, and the built conversation depends on such a message only
through its key -> value mapping), others by comparing ``plain_data`` bytes.  It builds
only the messages after that prefix and returns the new turn with its base.  Each later
stage decides for itself what it takes from the base and proves it exactly: the loops by
the identity of the message objects and equal free variables, the split by comparing
the texts, the keys by the shared pieces under the same key context.  A base that helps
little costs time, never correctness.  The base is given up once its turn is remembered:
tokenising the new turn may take the base's id and key lists over when no prompt holds
them any more (``SegmentEncoder.split(..., spend=True)``, ``PromptKeyer.keys``).

Memory is bounded: ``max_bytes`` counts the characters of the texts a turn holds, its
raw bytes, 8 bytes per token id of its split and a fixed cost per message (the
messages' own strings are shared with the request's conversation and are not counted
twice); the least recently rendered turns go first.  A turn replaces its base (the
conversation has moved on).  Not thread-safe: one per renderer, on one event loop.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from prompt.chat_messages import Message, build_conversation
from prompt.keyer import KeyResume
from prompt.message_loop import LoopRecord
from prompt.plain_data import plain_bytes
from prompt.segments import TextSplit
from prompt.template_env import ContentFormat

LOOKBACK = 8
"""How many messages shorter than the request a remembered turn may be: a reply and a
question, or an assistant turn with several tool calls and their results.  Each miss
costs one message key (a frozenset or a short pickle)."""

DEFAULT_MAX_TURN_BYTES = 64_000_000
"""A 10-turn, 6k-token conversation counts some 100 kB (its rendered text, the loop's
text, its split's ids): about 600 such conversations between turns."""

_MESSAGE_COST = 200
"""What a remembered message counts (its snapshot dict, its built dict, a record slot)."""

_ID_COST = 8
"""What a token id of a remembered split counts (a pointer to a shared int)."""

_Key = tuple[int, Hashable, Hashable]


@dataclass(slots=True, eq=False)
class Turn:
    """One rendered request of a conversation, as the next turn may reuse it."""

    snapshot: list[dict[str, str]] | None
    """Copies of the messages when they are all text-only (else ``None``)."""
    raw: bytes | None
    """The messages' ``plain_data`` bytes when they are not all text-only."""
    content_format: ContentFormat
    conversation: list[Message]
    """Built messages; shared with later turns, so never mutated."""
    key: _Key
    has_developer: bool = False
    """Some message of ``conversation`` has the role ``developer``."""
    loops: list[LoopRecord] = field(default_factory=list)
    text: str = ""
    split: TextSplit | None = None
    keys: KeyResume | None = None
    counted: int = 0
    """Its ``size()`` when the memo took it."""

    @property
    def n_messages(self) -> int:
        """Messages in the request."""
        return len(self.conversation)

    def size(self) -> int:
        """What the memo counts against ``max_bytes``."""
        return (
            len(self.raw or b"")
            + len(self.text)
            + sum(len(r.text) for r in self.loops)
            + _MESSAGE_COST * len(self.conversation)
            + (_ID_COST * len(self.split.ids) if self.split is not None else 0)
        )

    def same_messages(self, messages: list[Any], text_only: bool) -> bool:
        """Whether ``messages`` (as many as this turn's) are exactly this turn's."""
        if self.snapshot is not None:
            return (text_only or _text_only(messages)) and messages == self.snapshot
        return self.raw is not None and plain_bytes(messages) == self.raw


@dataclass(slots=True)
class TurnStats:
    """Counters of one memo (plain ints, for metrics)."""

    hits: int = 0
    misses: int = 0
    reused_messages: int = 0
    evictions: int = 0


class TurnMemo:
    """Recently rendered turns, found by an exact prefix of the request's messages."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_TURN_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = max_bytes
        self._turns: OrderedDict[_Key, Turn] = OrderedDict()
        self._bytes = 0
        self.stats = TurnStats()

    def begin(
        self, messages: object, content_format: ContentFormat
    ) -> tuple[Turn, Turn | None] | None:
        """The new turn for ``messages`` (conversation built) and the turn it extends.

        ``None`` when the messages are not a non-empty list of plain data: the caller
        builds the conversation itself (and reports invalid messages).
        """
        if type(messages) is not list or not messages:
            return None
        n = len(messages)
        text_only = _text_only(messages)
        keys: dict[int, Hashable | None] = {}

        def key_of(i: int) -> Hashable | None:
            if i not in keys:
                keys[i] = _message_key(messages[i], text_only)
            return keys[i]

        first = key_of(0)
        base: Turn | None = None
        for k in range(n, max(n - LOOKBACK, 0), -1):
            last = key_of(k - 1)
            if first is None or last is None:
                return None
            found = self._turns.get((k, first, last))
            if (
                found is not None
                and found.content_format == content_format
                and found.same_messages(messages[:k] if k < n else messages, text_only)
            ):
                base = found
                break
        raw: bytes | None = None
        if text_only:
            old = base.snapshot if base is not None and base.snapshot is not None else []
            snapshot: list[dict[str, str]] | None = [*old, *map(dict, messages[len(old) :])]
        else:
            snapshot, raw = None, plain_bytes(messages)
            if raw is None:
                return None
        reused = base.conversation if base is not None else []
        fresh = build_conversation(messages[len(reused) :], content_format)
        if not text_only:  # text-only messages are built into new containers already
            fresh = [_detached(m) for m in fresh]
        if base is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.reused_messages += len(reused)
        key = (n, first, key_of(n - 1))
        developer = (base is not None and base.has_developer) or any(
            m["role"] == "developer" for m in fresh
        )
        turn = Turn(snapshot, raw, content_format, [*reused, *fresh], key, developer)
        return turn, base

    def remember(self, turn: Turn, base: Turn | None) -> None:
        """Keep ``turn`` (most recent), dropping ``base`` and the oldest turns over
        the budget."""
        if base is not None:
            self._drop(base.key, base)
        self._drop(turn.key, None)
        size = turn.size()
        if size > self._max_bytes:
            return
        turn.counted = size
        self._turns[turn.key] = turn
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, old = self._turns.popitem(last=False)
            self._bytes -= old.counted
            self.stats.evictions += 1

    def recount(self, turn: Turn) -> None:
        """Count ``turn`` again after a stage attached more to it (its split)."""
        if self._turns.get(turn.key) is not turn:
            return
        size = turn.size()
        self._bytes += size - turn.counted
        turn.counted = size
        while self._bytes > self._max_bytes and self._turns:
            _, old = self._turns.popitem(last=False)
            self._bytes -= old.counted
            self.stats.evictions += 1

    def _drop(self, key: _Key, expected: Turn | None) -> None:
        current = self._turns.get(key)
        if current is not None and (expected is None or current is expected):
            del self._turns[key]
            self._bytes -= current.counted

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def held_bytes(self) -> int:
        """What the remembered turns count against ``max_bytes``."""
        return self._bytes

    def clear(self) -> None:
        """Forget every turn."""
        self._turns.clear()
        self._bytes = 0


_IMMUTABLE = frozenset({str, int, float, bool, bytes, type(None)})
_DICT = frozenset({dict})
_STR = frozenset({str})


def _text_only(messages: list[Any]) -> bool:
    """Every message an exact dict whose values are all exact strings (C-level scans)."""
    return {*map(type, messages)} <= _DICT and {
        *map(type, chain.from_iterable(map(dict.values, messages)))
    } <= _STR


def _message_key(message: Any, text_only: bool) -> Hashable | None:
    """An exact, hashable stand-in for one message (``None``: not plain data)."""
    if text_only or _text_only([message]):
        return frozenset(message.items())
    return plain_bytes(message)


def _detached(value: Any) -> Any:
    """``value`` with no container shared with the request (the built messages may hold
    the request's own lists and dicts): plain containers are copied, immutable leaves
    kept, anything else deep-copied."""
    kind = type(value)
    if kind is dict:
        return {k: _detached(v) for k, v in value.items()}
    if kind is list:
        return [_detached(v) for v in value]
    if kind in _IMMUTABLE:
        return value
    return copy.deepcopy(value)


__all__ = ["DEFAULT_MAX_TURN_BYTES", "LOOKBACK", "Turn", "TurnMemo", "TurnStats"]
