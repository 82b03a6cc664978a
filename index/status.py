"""What the router knows about each KV event source, as a frozen snapshot.

``SourceStatus`` is read by the router's scoring (how stale is a replica's index
entry?) and by ``/debug`` endpoints.  The ingesting process keeps one ``SourceTracker``
per source and hands out ``snapshot()``s; with a Redis index the lease owner also
publishes the snapshot to Redis (``publish_status``) so that routers that do not ingest
can read it (``read_status``).

Times: ``*_wall`` fields are ``time.time()`` seconds (comparable across processes);
``last_reset_monotonic`` is this process's ``time.monotonic()`` (``None`` when the
snapshot came from another process).  ``receive_lag_s`` is the wall-clock delay between
the engine stamping the last batch and this process receiving it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from kvkeys.types import ReplicaId

__all__ = ["SourceState", "SourceStatus", "status_from_json", "status_to_json"]

SourceState = Literal[
    "starting", "live", "resyncing", "degraded", "disconnected", "stopped", "standby"
]
"""``live``: applying events; ``resyncing``: clearing/replaying; ``degraded``: the index
or the replica's replay is unreachable (events may be lost; a resync follows);
``disconnected``: the engine's stream was lost for longer than the grace period, so its
entries were cleared (counted in ``resyncs``, ``last_reset_*`` set) and it is rebuilt
from sequence 0 when it connects again; ``standby``: another process holds the
ingestion lease."""


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """A snapshot of one event source (one replica, or one DP rank of it)."""

    replica: ReplicaId
    model: str
    endpoint: str | None
    state: SourceState = "starting"
    connected: bool = False
    """The SUB socket has a live connection to the publisher (connect mode), or the bound
    SUB has at least one peer (bind mode)."""
    last_seq: int | None = None
    last_event_wall: float | None = None
    """``ts`` of the last applied batch (the engine's ``time.time()``)."""
    last_receive_wall: float | None = None
    receive_lag_s: float | None = None
    block_size: int | None = None
    """The replica's block size, learned from its ``BlockStored`` events."""
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    """Times the replica's entries were cleared and rebuilt (restart, lost history,
    failed replay, index outage, lease takeover, disconnection, reconnection)."""
    undecodable: int = 0
    last_reset_wall: float | None = None
    last_reset_monotonic: float | None = None
    last_error: str | None = None
    owner: str | None = None
    """The process that ingests this source (the lease holder's id)."""

    def with_changes(self, **changes: Any) -> SourceStatus:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


def status_to_json(status: SourceStatus) -> str:
    """Serialise for Redis (``last_reset_monotonic`` is process-local and dropped)."""
    data = asdict(status)
    data["last_reset_monotonic"] = None
    return json.dumps(data, separators=(",", ":"))


def status_from_json(text: str | bytes) -> SourceStatus:
    """Parse what ``status_to_json`` wrote (unknown fields ignored)."""
    data = json.loads(text)
    fields = set(SourceStatus.__dataclass_fields__)
    kwargs = {k: v for k, v in data.items() if k in fields}
    kwargs["replica"] = ReplicaId(kwargs["replica"])
    return SourceStatus(**kwargs)
