"""Session affinity on a consistent-hash ring (uhashring's ketama continuum).

Two things live here:

* ``affinity_key(request, block_keys)``: the key a request is pinned by, from the most to
  the least specific source: the session key the proxy parsed (configured header, default
  ``X-Session-ID``, else the body's ``user``); for chat bodies, a hash of the first
  non-system message (stable across the turns of one conversation and different between
  users who share one system prompt, which a hash of the first blocks would not be); a
  hash of the prompt's first blocks (``prefix_blocks`` of them); the start of a
  completions prompt; and finally the request id (no affinity possible: spread).
* ``AffinityRing``: the ring over a candidate set.  Ketama places ``vnodes`` points per
  replica, so adding or removing one of N replicas moves about 1/N of the keys and no
  others.  Rings are cached per candidate set (building one costs ~1 ms per replica), so
  a replica going unhealthy moves only its own sessions, and they come back when it does.
  A ring never changes once built, so the order it gives a key is remembered too (per
  candidate set, key and length; ``max_orders``): walking the continuum costs tens of
  microseconds, and every turn of a session asks again.

Contract: no I/O, no clock.  The ring and order caches are bounded (``max_rings``,
``max_orders``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash
from uhashring import HashRing

from kvkeys.types import ReplicaId, RequestKey
from router.policy import RouteRequest

__all__ = ["AffinityKey", "AffinityRing", "KeySource", "affinity_key"]

KeySource = Literal["session", "first_message", "prompt_prefix", "request_id"]
"""Where an affinity key came from (a bounded metric label)."""

_FIRST_MESSAGE_CHARS = 65536
"""Characters of a first message hashed for its affinity key (past that, its length
stands for the rest)."""
_PROMPT_PREFIX_CHARS = 1024
"""Characters of a completions prompt hashed when no tokens are at hand: about the first
256 tokens, enough to tell conversations apart without reading a long prompt."""


@dataclass(frozen=True, slots=True)
class AffinityKey:
    """A ring key and its source."""

    key: str
    source: KeySource


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _first_message(body: Mapping[str, Any]) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        if message.get("role") in ("system", "developer"):
            continue
        content = message.get("content")
        if isinstance(content, str) and len(content) > _FIRST_MESSAGE_CHARS:
            # A huge first message: its start and length tell conversations apart just
            # as well, without serialising megabytes on the request path.
            head = content[:_FIRST_MESSAGE_CHARS].encode("utf-8", "surrogatepass")
            return _digest(b"M\x00%d\x00" % len(content) + head)
        try:
            raw = orjson.dumps(content)
        except TypeError:
            return None
        return _digest(b"m\x00" + raw)
    return None


def _prompt_start(body: Mapping[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _digest(b"p\x00" + prompt[:_PROMPT_PREFIX_CHARS].encode())
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _digest(b"t\x00" + orjson.dumps(prompt[: _PROMPT_PREFIX_CHARS // 4]))
    return None


def affinity_key(
    request: RouteRequest,
    block_keys: Sequence[RequestKey] = (),
    *,
    prefix_blocks: int = 8,
) -> AffinityKey:
    """The key ``request`` is pinned by on the ring (see the module docstring)."""
    if request.session_key:
        return AffinityKey(request.session_key, "session")
    body = request.body
    if body is not None and request.endpoint == "chat":
        first = _first_message(body)
        if first is not None:
            return AffinityKey(first, "first_message")
    if block_keys and prefix_blocks > 0:
        k = block_keys[min(prefix_blocks, len(block_keys)) - 1]
        return AffinityKey(f"b{k:x}", "prompt_prefix")
    if body is not None:
        start = _prompt_start(body)
        if start is not None:
            return AffinityKey(start, "prompt_prefix")
    return AffinityKey(request.request_id, "request_id")


class AffinityRing:
    """Consistent-hash preference orders over candidate sets."""

    def __init__(self, *, vnodes: int = 160, max_rings: int = 16,
                 max_orders: int = 8192) -> None:
        self._vnodes = vnodes
        self._max_rings = max_rings
        self._max_orders = max_orders
        self._rings: OrderedDict[frozenset[ReplicaId], HashRing] = OrderedDict()
        self._orders: OrderedDict[tuple[frozenset[ReplicaId], str, int],
                                  tuple[ReplicaId, ...]] = OrderedDict()
        """Ring orders already walked (about 200 bytes each): the active sessions'."""

    def _ring(self, candidates: Collection[ReplicaId]) -> HashRing:
        members = candidates if isinstance(candidates, frozenset) else frozenset(candidates)
        ring = self._rings.get(members)
        if ring is None:
            nodes = {r: {"vnodes": self._vnodes} for r in sorted(members)}
            ring = HashRing(nodes=nodes, hash_fn="ketama")
            self._rings[members] = ring
            while len(self._rings) > self._max_rings:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(members)
        return ring

    def first(self, key: str, candidates: Collection[ReplicaId]) -> ReplicaId:
        """The replica ``key`` is pinned to among ``candidates`` (never empty)."""
        if len(candidates) == 1:
            return next(iter(candidates))
        return ReplicaId(self._ring(candidates).get_node(key))

    def order(
        self, key: str, candidates: Collection[ReplicaId], size: int | None = None
    ) -> list[ReplicaId]:
        """``candidates`` in ring order from ``key``: the pinned replica, then where its
        sessions would go if it left, and so on (at most ``size``)."""
        if len(candidates) == 1:
            return list(candidates)
        members = frozenset(candidates)
        n = len(candidates) if size is None else min(size, len(candidates))
        entry = (members, key, n)
        order = self._orders.get(entry)
        if order is None:
            order = tuple(ReplicaId(node["nodename"])
                          for node in self._ring(members).range(key, n))
            self._orders[entry] = order
            if len(self._orders) > self._max_orders:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(entry)
        return list(order)

    def preference(self, key: str, candidates: Collection[ReplicaId]) -> dict[ReplicaId, int]:
        """Ring order as ranks (0 first), for ``scoring.pick``'s tie-breaking."""
        return {r: i for i, r in enumerate(self.order(key, candidates))}
