"""What moving a conversation costs the fleet, beyond the request itself.

The score (``router.scoring``) weighs one request's prefill against queues: leaving the
replica that holds a conversation's context costs the request the recomputation of that
context, and nothing else.  The fleet pays more.  When a later turn moves from its
origin ``o`` to a target ``t`` that holds ``delta`` fewer of its tokens
(``delta = expected_cached(o) - expected_cached(t)``):

* **Compute**: the target computes ``delta`` more tokens.  Every request that queues
  behind them on ``t`` waits for them too.  With ``t`` busy a share ``rho`` of the time
  (its measured prefill work over its configured prefill rate), a unit of work delays
  the requests arriving during the busy period it extends by ``rho / (1 - rho)`` units
  in total (M/G/1: the busy period started by one unit of work lasts ``1 / (1 - rho)``),
  so the others pay ``delta * rho / (1 - rho)``.
* **Cache at the target**: the ``delta`` tokens are allocated on ``t``, displacing
  other conversations' reusable blocks from the head of its LRU queue.
* **Cache at the origin**: the conversation's copy on ``o`` is stranded (its next turns
  follow it to ``t``), holding ``delta`` tokens of dead weight until LRU gets to them.

A displaced or stranded token is worth a future hit with the probability that context
on that replica is reused before LRU evicts it: ``reuse_share``, the share of returning
conversations that came back within the replica's eviction horizon (learnt online from
the session table's think times and the horizon estimator; Laplace-smoothed, unknown
until a return was seen, and unknown means free, like an unknown horizon elsewhere).

So a move costs ``delta * (rho_t / (1 - rho_t) + reuse_t + reuse_o)`` tokens on top of
the request's own ``delta``, weighed like the score's recomputation (``alpha``).  A
move happens only when the queue it avoids is larger: the latency gain must exceed the
fleet-wide loss.  Staying costs nothing extra (its new blocks extend its own run).  New
conversations have no origin and are not charged (their prompt is computed somewhere
anyway; a shared prefix is replicated by the placement term).

**Placing a new conversation** (``price_placement``) has no origin, but it commits the
conversation's context to its replica for its lifetime: about ``footprint`` tokens, the
mean context a conversation's turn leaves in the pool (learnt online from finished
turns, ``SessionTracker.footprint_blocks``).  Allocated on ``r``, they displace as much
context from the head of ``r``'s LRU queue, which would have been reused with the
chance ``reuse_r``.  So the placement costs the fleet ``footprint x reuse_r`` beyond the
request's own prefill.  A replica whose cache already misses its returning
conversations (low ``reuse``) is cheap to add to; one whose cache serves them is
protected: the fleet concentrates conversations where the cache is lost anyway instead
of spreading them evenly into every cache (session affinity's uneven load does this by
chance).  The queue terms bound it: a busy replica still scores its queue.  Only the
externality is charged: the conversation's own hits are the request's score and, on
later turns, its moves' price.

``rho`` is capped at ``MAX_BUSY`` (a replica measured at or beyond its configured rate
is saturated; the factor is then 19).  Pure: no clock, no state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvkeys.types import ReplicaId
from router.scoring import ReplicaScore

__all__ = ["MAX_BUSY", "FleetState", "busy_share", "move_cost", "price_moves",
           "price_placement"]

MAX_BUSY = 0.95
"""The largest busy share used: ``rho / (1 - rho)`` stays finite (19)."""


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class FleetState:
    """What the move cost reads of one replica."""

    busy: float | None = None
    """Share of the time the replica computes (``busy_share``); ``None`` unknown."""
    reuse: float | None = None
    """Chance its cached context is reused before eviction; ``None`` unknown."""


_UNKNOWN = FleetState()
"""A replica nothing is known of (a value: shared, never changed)."""


def busy_share(
    allocation_blocks_per_s: float | None, block_size: int, prefill_tokens_per_s: float
) -> float | None:
    """Tokens the replica computes per second (blocks allocated x block size) over its
    configured prefill rate, capped at ``MAX_BUSY``; ``None`` when not measured."""
    if allocation_blocks_per_s is None or prefill_tokens_per_s <= 0 or block_size <= 0:
        return None
    return min(MAX_BUSY, max(0.0, allocation_blocks_per_s * block_size / prefill_tokens_per_s))


def move_cost(delta_tokens: float, target: FleetState, origin: FleetState) -> float:
    """The fleet's cost, in tokens, of moving ``delta_tokens`` of context from the
    origin to the target (module docstring)."""
    if delta_tokens <= 0:
        return 0.0
    rho = target.busy or 0.0
    return delta_tokens * (rho / (1.0 - rho) + (target.reuse or 0.0) + (origin.reuse or 0.0))


def price_moves(
    ranked: Sequence[ReplicaScore],
    origin: ReplicaId | None,
    states: Mapping[ReplicaId, FleetState],
    alpha: float,
) -> tuple[list[ReplicaScore], dict[ReplicaId, float]]:
    """``ranked`` with the score of each non-origin replica that holds less of the
    conversation lowered by ``alpha x move_cost``, best first (ties keep their order);
    and the fleet costs charged."""
    home = next((s for s in ranked if s.replica == origin), None)
    if home is None or home.expected_cached_tokens <= 0:
        return list(ranked), {}
    o_state = states.get(home.replica, _UNKNOWN)
    out: list[ReplicaScore] = []
    costs: dict[ReplicaId, float] = {}
    for s in ranked:
        delta = home.expected_cached_tokens - s.expected_cached_tokens
        cost = move_cost(delta, states.get(s.replica, _UNKNOWN), o_state)
        if s is not home and cost > 0:
            costs[s.replica] = cost
            s = s.rescored(s.score - alpha * cost)
        out.append(s)
    out.sort(key=lambda s: -s.score)
    return out, costs


def price_placement(
    ranked: Sequence[ReplicaScore],
    states: Mapping[ReplicaId, FleetState],
    footprint_tokens: float | None,
    alpha: float,
) -> tuple[list[ReplicaScore], dict[ReplicaId, float]]:
    """``ranked`` (a new conversation's scores) with each replica's score lowered by
    ``alpha x footprint_tokens x reuse`` (module docstring), best first (ties keep their
    order); and the fleet costs charged.  Nothing is charged while the footprint or a
    replica's reuse is unknown."""
    if footprint_tokens is None or footprint_tokens <= 0:
        return list(ranked), {}
    out: list[ReplicaScore] = []
    costs: dict[ReplicaId, float] = {}
    for s in ranked:
        cost = footprint_tokens * (states.get(s.replica, _UNKNOWN).reuse or 0.0)
        if cost > 0:
            costs[s.replica] = cost
            s = s.rescored(s.score - alpha * cost)
        out.append(s)
    out.sort(key=lambda s: -s.score)
    return out, costs
