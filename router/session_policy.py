"""The ``session`` policy: consistent-hash session affinity, nothing else.

Each request is pinned by its ``affinity_key`` (session header, body ``user``, first
chat message, prompt prefix; the request id when there is none) on a uhashring ketama
ring over the candidates; the rest of the ring order is the failover order.  It never
looks at the KV index or at load: it is the baseline the ``kv`` policy is compared
against on identical traffic (select it per request with the policy header), and it
reports the same stickiness counter (``router_session_turns_total``).

Reasons (bounded): ``session``, ``first_message``, ``prompt_prefix``, ``request_id`` (the
source of the key).  Adding or removing one of N replicas moves about 1/N of sessions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvkeys.types import ReplicaId
from router.affinity import AffinityRing, affinity_key
from router.metrics import KvMetrics
from router.policy import Decision, Receipt, RouteRequest
from router.session_table import SessionTable

__all__ = ["SessionPolicy"]


class SessionPolicy:
    """Pin sessions to replicas on a consistent-hash ring."""

    name = "session"

    def __init__(
        self,
        *,
        ring: AffinityRing | None = None,
        sessions: SessionTable | None = None,
        metrics: KvMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ring = ring if ring is not None else AffinityRing()
        self.sessions = sessions if sessions is not None else SessionTable(max_token_bytes=0)
        self._metrics = metrics
        self._clock = clock

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """The ring order of the request's affinity key."""
        key = affinity_key(request)
        order = self.ring.order(key.key, candidates)
        if key.source != "request_id":
            previous = self.sessions.turn(key.key, order[0], self._clock(), b"", None)
            if previous is not None and self._metrics is not None:
                placement = "same_replica" if previous.replica == order[0] else "moved"
                self._metrics.session_turns.labels(self.name, placement).inc()
        return Decision(tuple(order), self.name, key.source, want_usage=False)

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Nothing to learn."""
