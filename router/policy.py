"""The routing port: how the proxy asks "where should this request go?".

A policy sees a ``RouteRequest`` (what the router parsed from the request) and the
candidate replicas (healthy, serving the model), and returns a ``Decision``: an ordered
list of replicas (the first is the choice, the rest are failover candidates), the reason,
and for KV-aware policies the prediction that the receipt is later checked against.
A policy that needs to carry its own state from ``route`` to ``record`` puts it in the
decision's ``ticket``, typed by the policy (``Decision[KvTicket]``); everyone else sees
an opaque value.

The proxy never knows which policy it runs: ``round_robin``, ``least_loaded``,
``random``, ``session`` and ``kv`` all implement ``Policy``.  After the response, the
proxy hands the policy a ``Receipt`` (what the replica reported), so a policy can learn
and the router can measure its predictions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol

from typing_extensions import TypeVar

from kvkeys.types import ReplicaId

Endpoint = Literal["chat", "completions", "other"]

TicketT = TypeVar("TicketT", default=Any)
"""A policy's own state carried from ``route`` to ``record`` (opaque to the proxy)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may see of one request: parsed once by the proxy, read-only."""

    request_id: str
    endpoint: Endpoint
    path: str
    model: str | None
    body: Mapping[str, Any] | None
    """The parsed JSON body (``None`` for bodies that are not JSON objects)."""
    session_key: str | None
    """From the configured session header, else the body's ``user`` field."""
    policy_override: str | None = None
    """The policy named by the per-request header, if any."""


@dataclass(frozen=True, slots=True)
class Decision(Generic[TicketT]):
    """Where a request goes, why, and what the policy expects the replica to report."""

    replicas: tuple[ReplicaId, ...]
    """Ordered candidates: ``replicas[0]`` is the choice; the rest are for failover."""
    policy: str
    reason: str
    """A small enum per policy (bounded metric label), e.g. ``kv_hit``, ``affinity``."""
    prompt_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    want_usage: bool = False
    """Ask the replica for ``usage`` on streams (the proxy strips the extra chunk)."""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """Debug output only (``/debug/route``, the debug log): no policy reads it back."""
    ticket: TicketT | None = None
    """The deciding policy's own state for ``record``; nobody else reads it."""

    @property
    def replica(self) -> ReplicaId:
        """The chosen replica."""
        return self.replicas[0]


@dataclass(frozen=True, slots=True)
class Receipt:
    """What came back: the replica that served, and its usage report if it sent one."""

    replica: ReplicaId
    ok: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttfb_s: float | None = None
    completion_tokens: int | None = None


class Policy(Protocol[TicketT]):
    """A routing policy.  ``route`` must not block the event loop."""

    name: str

    async def route(
        self, request: RouteRequest, candidates: Sequence[ReplicaId]
    ) -> Decision[TicketT]:
        """Order ``candidates`` (never empty) for ``request``."""
        ...

    def record(
        self, request: RouteRequest, decision: Decision[TicketT], receipt: Receipt
    ) -> None:
        """Learn from what the chosen replica reported (called once per request)."""
        ...
