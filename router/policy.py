"""The routing port: how the proxy asks "where should this request go?".

A policy sees a ``RouteRequest`` (what the router parsed from the request) and the
candidate replicas (healthy, serving the model), and returns a ``Decision``: an ordered
list of replicas (the first is the choice, the rest are failover candidates), the reason,
and for KV-aware policies the prediction that the receipt is later checked against.

The proxy never knows which policy it runs: ``round_robin``, ``least_loaded``,
``random``, ``session`` and ``kv`` all implement ``Policy``.  After the response, the
proxy hands the policy a ``Receipt`` (what the replica reported), so a policy can learn
and the router can measure its predictions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvkeys.types import ReplicaId

Endpoint = Literal["chat", "completions", "other"]


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
class Decision:
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
    """Per-replica breakdown for ``/debug/route`` and the debug log."""

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


class Policy(Protocol):
    """A routing policy.  ``route`` must not block the event loop."""

    name: str

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        """Order ``candidates`` (never empty) for ``request``."""
        ...

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        """Learn from what the chosen replica reported (called once per request)."""
        ...
