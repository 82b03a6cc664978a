"""A rendered prompt as the engine will see it: token ids, block keys, block size.

``Prompt`` is the value every consumer shares (router policy, simulated replica,
diagnostics).  Its ``block_keys`` are ``kvkeys.keys.block_keys(token_ids, block_size,
model=model, cache_salt=cache_salt, lora_name=lora_name)``: chained keys of the full
blocks only, the salt folded into block 0, the LoRA adapter name into every block,
``model`` being the *base* model the replica serves.

``PromptKeyer`` computes those keys incrementally.  A prompt arrives as a sequence of
segments (``prompt.segments``), each with a serial number that identifies its exact
token ids.  The keyer memoises the hash chain state after each segment, keyed by
(state before, segment serial), so a prompt that extends a previous one only hashes the
blocks its new segments complete (in one ``block_keys`` call for all of them).  The
memo is bounded (a trie of at most ``max_nodes`` units of ~200 bytes, a state plus its
keys, dropped whole when full); a
miss only costs recomputation, and the result is always equal to ``block_keys`` over
the whole token list (a property test checks this).

A prompt that starts with the very segments of an earlier one can skip even the walk
down the trie: ``trail(ctx, segments, previous=trail, shared=n)`` starts from the state
the earlier prompt reached after its first ``n`` segments (its ``KeyTrail``: the state
after each of its segments and its keys, used only under the same ``KeyContext``) and
returns this prompt's own trail.  Trails are values: neither is changed, a trail stays
valid after the trie is dropped, and the new trail's keys are the earlier keys up to
the shared state plus the keys of the blocks after it.

``validate_cache_salt`` applies vLLM 0.30+'s rule, raising ``InvalidCacheSalt`` (HTTP
400).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvkeys.keys import block_keys, expected_cached_tokens
from kvkeys.types import RequestKey
from prompt.errors import InvalidCacheSalt
from prompt.segments import Segment

MAX_CACHE_SALT_LENGTH = 128
_FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")

DEFAULT_MAX_KEY_NODES = 200_000
"""Memoised chain states, in units of about 200 bytes: a state costs ``_STATE_UNITS``
plus one per ``_KEYS_PER_UNIT`` block keys it holds (a state after a long segment holds
many), so the trie stays under ``max_nodes`` x 200 bytes (~40 MB by default, some
3,000 ten-turn conversations)."""
_STATE_UNITS = 3
"""Units of one state: the object, its children dict, its leftover-token tuple and its
key list (measured: about 530 bytes)."""
_KEYS_PER_UNIT = 5
"""Block keys per unit: a key is an int (36 bytes) and its list slot (8)."""


def validate_cache_salt(cache_salt: object) -> str | None:
    """Return ``cache_salt`` if vLLM would accept it, else raise ``InvalidCacheSalt``.

    ``None`` means no salt.  Otherwise it must be a non-empty string of at most 128
    characters without ``@``, ``/``, ``\\`` or NUL (vLLM 0.30+; older versions only
    required a non-empty string, so this is the stricter, forward-compatible rule).
    """
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidCacheSalt("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH or not _FORBIDDEN_SALT_CHARS.isdisjoint(cache_salt):
        raise InvalidCacheSalt(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL."
        )
    return cache_salt


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt, tokenised and keyed exactly as the engine will see it.

    ``token_ids`` (a list, or ``prompt.token_ids.TokenIds`` when rendered here) and
    ``block_keys`` are read-only: the renderer keeps them to build the conversation's
    next turn from.
    """

    token_ids: Sequence[int]
    block_keys: list[RequestKey]
    block_size: int
    model: str
    """The base model the replica serves (the root of the key chain)."""
    lora_name: str | None = None
    cache_salt: str | None = None
    source: Literal["local", "remote"] = "local"
    """Rendered here, or by a replica (``prompt.remote_render``)."""

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.token_ids)

    def expected_cached_tokens(self, matched_blocks: int) -> int:
        """Tokens the engine serves from cache when ``matched_blocks`` leading blocks are
        held: full blocks only, and never the last prompt token (vLLM recomputes it)."""
        return expected_cached_tokens(matched_blocks, len(self.token_ids), self.block_size)


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What a key chain depends on besides the tokens."""

    model: str
    block_size: int
    cache_salt: str | None = None
    lora_name: str | None = None


class _Node:
    """Chain state after a prefix: full blocks so far, last key, leftover tokens, and
    the states reached from here by each next segment (by serial)."""

    __slots__ = ("children", "keys", "last", "n_blocks", "tail")

    def __init__(
        self,
        n_blocks: int,
        last: RequestKey | None,
        tail: tuple[int, ...],
        keys: list[RequestKey],
    ) -> None:
        self.n_blocks = n_blocks
        self.last = last
        self.tail = tail
        self.keys = keys
        self.children: dict[int, _Node] = {}


@dataclass(frozen=True, slots=True)
class KeyTrail:
    """The chain states one keyed prompt reached: ``nodes[i]`` after its segment ``i``,
    under ``ctx``; ``keys`` are that prompt's block keys (read-only)."""

    ctx: KeyContext
    nodes: tuple[_Node, ...]
    keys: list[RequestKey]
    generation: int = 0
    """The keyer's trie generation the nodes belong to: a later
    prompt resumes from them only in the same generation, so a dropped trie is not grown
    on (and kept alive) through the trails of remembered prompts."""


class PromptKeyer:
    """Block keys of segmented prompts, memoised as a trie of (chain state, segment).

    The trie holds at most ``max_nodes`` states.  When full it is dropped whole and
    regrown (a generational reset): one prompt after a reset pays the cold cost, which
    keeps every hit free of LRU bookkeeping.
    """

    def __init__(self, *, max_nodes: int = DEFAULT_MAX_KEY_NODES) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        self._max_nodes = max_nodes
        self._nodes = 0
        self._roots: dict[KeyContext, _Node] = {}
        self.misses = 0
        self.resets = 0
        self._generation = 0
        """Bumped whenever the trie is dropped (``KeyTrail.generation``)."""

    def keys(self, ctx: KeyContext, segments: Sequence[Segment]) -> list[RequestKey]:
        """``block_keys`` of the concatenated segment ids under ``ctx``."""
        out: list[RequestKey] = []
        self._walk(ctx, self._root(ctx), segments, out, None)
        return out

    def trail(
        self,
        ctx: KeyContext,
        segments: Sequence[Segment],
        *,
        previous: KeyTrail | None = None,
        shared: int = 0,
    ) -> KeyTrail:
        """``keys(ctx, segments)`` with the states after each segment.

        With ``previous`` keyed under ``ctx`` and ``0 < shared <= len(previous.nodes)``
        (the caller guarantees that the first ``shared`` segments are ``previous``'s),
        the walk starts from ``previous``'s state after them.
        """
        if (previous is not None and previous.ctx == ctx and previous.generation == self._generation
                and 0 < shared <= len(previous.nodes)):
            nodes = list(previous.nodes[:shared])
            start = nodes[-1]
            out = previous.keys[: start.n_blocks]
            self._walk(ctx, start, segments[shared:], out, nodes)
        else:
            nodes = []
            out = []
            self._walk(ctx, self._root(ctx), segments, out, nodes)
        return KeyTrail(ctx, tuple(nodes), out, self._generation)

    def _root(self, ctx: KeyContext) -> _Node:
        node = self._roots.get(ctx)
        if node is None:
            node = self._roots[ctx] = _Node(0, None, (), [])
            self._count_node()
        return node

    def _walk(
        self,
        ctx: KeyContext,
        node: _Node,
        segments: Sequence[Segment],
        out: list[RequestKey],
        nodes: list[_Node] | None,
    ) -> None:
        """Append the keys ``segments`` complete after ``node`` to ``out`` (and the state
        after each segment to ``nodes``): memoised states first, then ``_grow``."""
        for i, (serial, ids) in enumerate(segments):
            if ids:
                child = node.children.get(serial)
                if child is None:
                    self._grow(ctx, node, segments[i:] if i else segments, out, nodes)
                    return
                if child.keys:
                    out.extend(child.keys)
                node = child
            if nodes is not None:
                nodes.append(node)

    def _grow(
        self,
        ctx: KeyContext,
        node: _Node,
        segments: Sequence[Segment],
        out: list[RequestKey],
        nodes: list[_Node] | None,
    ) -> None:
        """Key ``segments``, the first of which is not a child of ``node``: the blocks
        they complete are hashed in one ``block_keys`` call, then the state after each
        segment is added to the trie (and to ``nodes``)."""
        bs = ctx.block_size
        pending: list[int] = [*node.tail]
        ends: list[int] = []
        for _, ids in segments:
            pending += ids
            ends.append(len(pending))
        full = len(pending) // bs
        keys: list[RequestKey] = []
        if full:
            keys = block_keys(
                pending[: full * bs],
                bs,
                model=ctx.model,
                cache_salt=ctx.cache_salt,
                lora_name=ctx.lora_name,
                parent=node.last,
                first_block_index=node.n_blocks,
            )
            out += keys
        base_blocks, base_last = node.n_blocks, node.last
        done = 0  # blocks of ``keys`` completed by the segments so far
        for (serial, ids), end in zip(segments, ends, strict=True):
            if ids:
                blocks = end // bs
                child = _Node(
                    base_blocks + blocks,
                    keys[blocks - 1] if blocks else base_last,
                    tuple(pending[blocks * bs : end]),
                    keys[done:blocks] if blocks > done else [],
                )
                done = blocks
                node.children[serial] = child
                self.misses += 1
                self._count_node(_STATE_UNITS + len(child.keys) // _KEYS_PER_UNIT)
                node = child
            if nodes is not None:
                nodes.append(node)

    def _count_node(self, units: int = _STATE_UNITS) -> None:
        self._nodes += units
        if self._nodes > self._max_nodes:
            # Drop every memoised state; nodes already reached stay valid for the
            # prompt being keyed (they are plain values), and regrow from the roots.
            self._roots.clear()
            self._nodes = 0
            self._generation += 1
            self.resets += 1

    def clear(self) -> None:
        """Forget every memoised state."""
        self._roots.clear()
        self._nodes = 0
        self._generation += 1


__all__ = [
    "DEFAULT_MAX_KEY_NODES",
    "MAX_CACHE_SALT_LENGTH",
    "KeyContext",
    "KeyTrail",
    "Prompt",
    "PromptKeyer",
    "validate_cache_salt",
]
