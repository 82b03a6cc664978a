"""What the router remembers about each session between its turns.

Per session key (an ``affinity_key``): the replica its last turn went to, when that turn
was routed and when it finished, and the last prompt's tokens and shape (for
``prefix_breaks``).  That is what the KV policy needs to measure stickiness (did a later
turn land on the previous replica?), think time (gap between a turn finishing and the
next arriving), and the age of a session's blocks on its replica (for the eviction term).

Bounded: at most ``max_sessions`` sessions and ``max_token_bytes`` bytes, counting each
session's kept tokens (4 bytes per token), its prompt shape (16 bytes per message
digest and role) and ``ENTRY_BYTES`` for the entry itself (the 32-character key, the
state object, the slot); the least recently seen sessions go first.  Session keys are
fixed-size hashes (``router.request.session_key``), so a client's string never grows
an entry.  Synchronous methods
only, so every update is atomic on the event loop.  Times are passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvkeys.types import ReplicaId, RequestKey
from router.prefix_breaks import PromptShape

__all__ = ["SessionState", "SessionTable"]


@dataclass(slots=True)
class SessionState:
    """One session's last turn."""

    replica: ReplicaId
    routed_at: float
    tokens: bytes = b""
    shape: PromptShape | None = None
    finished_at: float | None = None
    turns: int = 1
    alloc_mark: float | None = None
    """The replica's allocation count when the turn finished (``HorizonEstimator``)."""
    free_mark: float | None = None
    """The replica's free blocks when the turn finished."""
    blocks_mark: int | None = None
    """The blocks the turn released when it finished (prompt and output)."""
    left: ReplicaId | None = None
    """The replica the session last moved away from, if it ever moved."""
    last_key: RequestKey | None = None
    """The block key of the last full block of ``tokens`` (``None``: not known), which
    proves the next prompt extends them without comparing every token."""


ENTRY_BYTES = 512
"""What one session costs besides its tokens and shape: the key, the state, the slot."""


def _size(state: SessionState) -> int:
    shape = state.shape
    return (len(state.tokens) + ENTRY_BYTES
            + (16 * len(shape.messages) if shape is not None else 0))


class SessionTable:
    """LRU of sessions, bounded in count and in kept token bytes."""

    def __init__(self, *, max_sessions: int = 100_000, max_token_bytes: int = 64 << 20):
        self.max_sessions = max_sessions
        self.max_token_bytes = max_token_bytes
        self._s: OrderedDict[str, SessionState] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._s)

    @property
    def token_bytes(self) -> int:
        """Bytes counted against ``max_token_bytes`` (tokens, shapes, entries)."""
        return self._bytes

    def get(self, key: str) -> SessionState | None:
        """The session's last turn, if remembered (does not refresh recency)."""
        return self._s.get(key)

    def turn(
        self,
        key: str,
        replica: ReplicaId,
        now: float,
        tokens: bytes,
        shape: PromptShape | None,
        last_key: RequestKey | None = None,
    ) -> SessionState | None:
        """Record a new turn routed to ``replica``; return the previous turn's state
        (a copy, for comparisons), or ``None`` for a new session."""
        old = self._s.get(key)
        previous = None
        if old is not None:
            previous = SessionState(
                old.replica, old.routed_at, old.tokens, old.shape, old.finished_at, old.turns,
                old.alloc_mark, old.free_mark, old.blocks_mark, old.left, old.last_key,
            )
            if replica != old.replica:
                old.left = old.replica
            self._bytes -= _size(old)
            old.replica, old.routed_at, old.tokens, old.shape = replica, now, tokens, shape
            old.last_key = last_key
            old.finished_at = None
            old.alloc_mark = old.free_mark = old.blocks_mark = None
            old.turns += 1
            self._s.move_to_end(key)
        else:
            self._s[key] = SessionState(replica, now, tokens, shape, last_key=last_key)
        self._bytes += _size(self._s[key])
        self._trim()
        return previous

    def finished(
        self,
        key: str,
        replica: ReplicaId,
        now: float,
        *,
        alloc_mark: float | None = None,
        free_mark: float | None = None,
        blocks_mark: int | None = None,
    ) -> None:
        """The turn routed to ``replica`` finished at ``now`` (with the replica's
        allocation count and free pool then, and the blocks the turn released, when
        known)."""
        state = self._s.get(key)
        if state is not None and state.replica == replica:
            state.finished_at = now
            state.alloc_mark, state.free_mark = alloc_mark, free_mark
            state.blocks_mark = blocks_mark

    def _trim(self) -> None:
        while self._s and (
            len(self._s) > self.max_sessions or self._bytes > self.max_token_bytes
        ):
            _, state = self._s.popitem(last=False)
            self._bytes -= _size(state)
