"""A conversation's cached prompt: what the next turn of a recent conversation reuses.

A chat client re-sends the whole conversation on every turn, so the request of turn
N+1 starts with the messages of turn N's request.  ``ConversationMemo`` keeps, per
recently rendered conversation, one ``CachedPrompt``: the owner of that conversation's
previous prompt, at every stage of the pipeline (``prompt.render``):

* ``messages`` (``BuiltMessages``): the request's messages, to compare the next request
  with (for text-only messages, exact dicts whose values are all exact strings, a
  shallow copy, ``snapshot``; for others their ``prompt.plain_data`` bytes, ``raw``),
  and the conversation as built for the template (``prompt.chat_messages``), one object
  per message, sharing no container with the request;
* ``loops``: the template's message loops as rendered (``prompt.message_loop``);
* ``split``: the rendered text, cut into pieces with their token ids
  (``prompt.segments.TextSplit``);
* ``keys``: the block keys with the chain state after each piece (``prompt.keyer``).

A ``CachedPrompt`` is a value: built once, when its turn has gone through every stage,
and never changed.  The next turn's is the shared prefix of the previous one plus what
is new, at each stage: messages built only past the shared ones, loop bodies rendered
only for new messages, text cut and encoded only past the shared pieces, keys hashed
only for the blocks after the shared ones, as vLLM's request extends its own
``block_hashes``.  It then replaces the previous one in the memo.

``open(messages, content_format)`` looks for the remembered prompt whose messages are
the longest prefix of this request's, at most ``LOOKBACK`` messages shorter (the
previous turn, a retry) or, for text-only messages, the remembered prompt that has those
messages plus one more (the request replaces its last message: a regenerated or edited
question; found by ``BuiltMessages.history_key``), and accepts it only if those messages
are exactly equal, never by a hash: text-only messages by ``==`` (C speed; with exact
string values ``==`` is exact, and the built conversation depends on such a message only
through its key -> value mapping), others by comparing ``plain_data`` bytes.  It builds
only the messages after that prefix.  Each later stage decides for itself what it takes
from the previous prompt and proves it exactly: the loops by the identity of the message
objects and equal free variables, the split by comparing the texts, the keys by the
shared pieces under the same key context.  A previous prompt that helps little costs
time, never correctness.

Memory is bounded: ``max_bytes`` counts the characters of the texts a prompt holds,
its raw bytes, 8 bytes per token id of its split and a fixed cost per message (the
messages' own strings are shared with the request's conversation and are not counted
twice); the least recently rendered prompts go first.  Not thread-safe: one per
renderer, on one event loop.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from prompt.chat_messages import Message, build_conversation
from prompt.keyer import KeyTrail
from prompt.message_loop import LoopRecord
from prompt.plain_data import plain_bytes
from prompt.segments import TextSplit
from prompt.template_env import ContentFormat

LOOKBACK = 8
"""How many messages shorter than the request a remembered prompt may be: a reply and
a question, or an assistant turn with several tool calls and their results.  Each miss
costs one message key (a frozenset or a short pickle)."""

DEFAULT_MAX_TURN_BYTES = 64_000_000
"""A 10-turn, 6k-token conversation counts some 100 kB (its rendered text, the loop's
text, its split's ids): about 600 such conversations between turns."""

_MESSAGE_COST = 200
"""What a remembered message counts (its snapshot dict, its built dict, a record slot)."""

_ID_COST = 8
"""What a token id of a remembered split counts (a pointer to a shared int)."""

_Key = tuple[int, Hashable, Hashable]


@dataclass(frozen=True, slots=True, eq=False)
class BuiltMessages:
    """A request's messages, as compared with the next request and as built for the
    template (the first stage's output)."""

    snapshot: list[dict[str, str]] | None
    """Copies of the messages when they are all text-only (else ``None``)."""
    raw: bytes | None
    """The messages' ``plain_data`` bytes when they are not all text-only."""
    content_format: ContentFormat
    conversation: list[Message]
    """Built messages; shared with later turns, so never mutated."""
    key: _Key
    has_developer: bool
    """Some message of ``conversation`` has the role ``developer``."""
    history_key: _Key | None = None
    """The key of the messages before the last one (text-only messages only): a request
    that keeps them and replaces the last one (a regenerated or edited question) finds
    this prompt by it."""

    def same_messages(self, messages: list[Any], text_only: bool) -> bool:
        """Whether ``messages`` (as many as these) are exactly these."""
        if self.snapshot is not None:
            return (text_only or _text_only(messages)) and messages == self.snapshot
        return self.raw is not None and plain_bytes(messages) == self.raw


@dataclass(frozen=True, slots=True, eq=False)
class CachedPrompt:
    """One conversation's prompt at every stage, as its next turn may reuse it."""

    messages: BuiltMessages
    loops: Sequence[LoopRecord] = ()
    split: TextSplit | None = None
    """``None`` when the text was not tokenised through a split (special tokens added)."""
    keys: KeyTrail | None = None
    """``None`` when the ids were not keyed (no key context, or truncated)."""

    def size(self) -> int:
        """What the memo counts against ``max_bytes``."""
        split = self.split
        return (
            len(self.messages.raw or b"")
            + (len(split.text) + _ID_COST * len(split.ids) if split is not None else 0)
            + sum(len(r.text) for r in self.loops)
            + _MESSAGE_COST * len(self.messages.conversation)
        )


@dataclass(frozen=True, slots=True)
class Opened:
    """The request's messages built, and the remembered prompt they extend."""

    messages: BuiltMessages
    previous: CachedPrompt | None


@dataclass(slots=True)
class ConversationStats:
    """Counters of one memo (plain ints, for metrics)."""

    hits: int = 0
    misses: int = 0
    reused_messages: int = 0
    evictions: int = 0


class ConversationMemo:
    """Recently rendered prompts, found by an exact prefix of the request's messages."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_TURN_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = max_bytes
        self._prompts: OrderedDict[_Key, tuple[CachedPrompt, int]] = OrderedDict()
        self._by_history: dict[_Key, CachedPrompt] = {}
        """Remembered text-only prompts by their ``history_key`` (the latest of each)."""
        self._bytes = 0
        self.stats = ConversationStats()

    def open(self, messages: object, content_format: ContentFormat) -> Opened | None:
        """``messages`` built (reusing the longest remembered prefix), and that prefix's
        prompt.

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
        found = self._find(messages, key_of, content_format, text_only)
        if first is None or found is None:
            return None
        previous, shared = found
        base = previous.messages if previous is not None else None
        raw: bytes | None = None
        if text_only:
            old = base.snapshot[:shared] if base is not None and base.snapshot is not None else []
            snapshot: list[dict[str, str]] | None = [*old, *map(dict, messages[len(old) :])]
        else:
            snapshot, raw = None, plain_bytes(messages)
            if raw is None:
                return None
        reused = base.conversation[:shared] if base is not None else []
        fresh = build_conversation(messages[len(reused) :], content_format)
        if not text_only:  # text-only messages are built into new containers already
            fresh = [_detached(m) for m in fresh]
        if base is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.reused_messages += len(reused)
        developer = any(m["role"] == "developer" for m in fresh) or (
            base is not None and base.has_developer and (
                len(reused) == len(base.conversation)
                or any(m["role"] == "developer" for m in reused)))
        history = (n - 1, first, key_of(n - 2)) if text_only and n > 1 else None
        built = BuiltMessages(
            snapshot, raw, content_format, [*reused, *fresh], (n, first, key_of(n - 1)),
            developer, history,
        )
        return Opened(built, previous)

    def _find(
        self,
        messages: list[Any],
        key_of: Callable[[int], Hashable | None],
        content_format: ContentFormat,
        text_only: bool,
    ) -> tuple[CachedPrompt | None, int] | None:
        """The remembered prompt the request extends (or replaces the last message of)
        and how many of its messages it shares; ``None``: a message is not plain data."""
        n, first = len(messages), key_of(0)
        for k in range(n, max(n - LOOKBACK, 0), -1):
            last = key_of(k - 1)
            if first is None or last is None:
                return None
            found = self._prompts.get((k, first, last))
            if found is not None:
                built = found[0].messages
                if built.content_format == content_format and built.same_messages(
                    messages[:k] if k < n else messages, text_only
                ):
                    return found[0], k
            sibling = self._sibling((k, first, last), messages, k, content_format, text_only)
            if sibling is not None:
                return sibling, k
        return None, 0

    def _sibling(
        self,
        key: _Key,
        messages: list[Any],
        k: int,
        content_format: ContentFormat,
        text_only: bool,
    ) -> CachedPrompt | None:
        """The remembered prompt whose messages are the first ``k`` of ``messages``
        (``key``) plus one more (the request replaces that last message)."""
        prompt = self._by_history.get(key)
        if prompt is None or not text_only:
            return None
        head = messages[:k]
        built = prompt.messages
        current = self._prompts.get(built.key)
        if current is None or current[0] is not prompt or built.snapshot is None:
            return None
        if built.content_format != content_format or head != built.snapshot[:k]:
            return None
        return prompt

    def remember(self, prompt: CachedPrompt, *, replacing: CachedPrompt | None) -> None:
        """Keep ``prompt`` (most recent) in place of ``replacing`` (the conversation has
        moved on), dropping the oldest prompts over the budget."""
        if replacing is not None:
            self._drop(replacing.messages.key, replacing)
        key = prompt.messages.key
        self._drop(key, None)
        size = prompt.size()
        if size > self._max_bytes:
            return
        self._prompts[key] = (prompt, size)
        self._bytes += size
        if prompt.messages.history_key is not None:
            self._by_history[prompt.messages.history_key] = prompt
        while self._bytes > self._max_bytes:
            _, (evicted, old) = self._prompts.popitem(last=False)
            self._forget_history(evicted)
            self._bytes -= old
            self.stats.evictions += 1

    def _drop(self, key: _Key, expected: CachedPrompt | None) -> None:
        current = self._prompts.get(key)
        if current is not None and (expected is None or current[0] is expected):
            del self._prompts[key]
            self._forget_history(current[0])
            self._bytes -= current[1]

    def _forget_history(self, prompt: CachedPrompt) -> None:
        history = prompt.messages.history_key
        if history is not None and self._by_history.get(history) is prompt:
            del self._by_history[history]

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def held_bytes(self) -> int:
        """What the remembered prompts count against ``max_bytes``."""
        return self._bytes

    def clear(self) -> None:
        """Forget every prompt."""
        self._prompts.clear()
        self._by_history.clear()
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


__all__ = [
    "DEFAULT_MAX_TURN_BYTES",
    "LOOKBACK",
    "BuiltMessages",
    "CachedPrompt",
    "ConversationMemo",
    "ConversationStats",
    "Opened",
]
