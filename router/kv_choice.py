"""The ``kv`` policy's last step: from ranked replicas to an ordered choice and a reason.

Either the score decides (``pick``: best score, ties by the request's ring order, or a
softmax draw at a positive temperature), or, when the index has nothing useful, session
affinity does: the session's previous replica, else ring order, unless the pinned
replica's load exceeds the least loaded's by ``balance_abs_tokens`` and ``balance_rel``x.

Reasons (bounded label values): ``kv_hit`` (the chosen replica has the best expected
hit), ``kv_shared`` (it has, but every candidate holds as much: only a prefix every
replica holds, such as a shared system prompt, was there to find), ``kv_load`` (load
outweighed a better hit elsewhere), ``kv_new`` (no hit anywhere and every event source
live: a new prefix, placed by load), ``affinity_no_hit`` (no useful hit while some event
source is not live: the index may not know), ``affinity_index_down``,
``affinity_no_prompt``, ``affinity_overload``.

Hits are compared in whole blocks (expected cached tokens over the block size, rounded
to the nearest block): an expected hit a rounding error below a block boundary (a trust
just under one) neither flips the reason nor the ``min_hit_tokens`` fallback.

Pure apart from the sampler, which is called only when a softmax draw is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvkeys.types import ReplicaId
from router.scoring import ReplicaScore, ScoringWeights, pick

__all__ = ["Choice", "ChoiceRules", "Fallback", "affinity_order", "choose"]

Fallback = Literal["no_prompt", "index_down", "no_hit"]
"""Why the index could not decide: no exact prompt, index unavailable, or no useful hit
while some candidate's event source was not live."""


@dataclass(frozen=True, slots=True)
class ChoiceRules:
    """The settings the choice reads."""

    weights: ScoringWeights
    min_hit_tokens: int
    temperature: float
    balance_abs_tokens: float
    balance_rel: float


@dataclass(slots=True)  # built per decision; frozen would cost 5x (setattr per field)
class Choice:
    """Ordered replicas (the first is chosen), the reason, and the fallback taken."""

    ordered: list[ReplicaScore]
    reason: str
    fallback: Fallback | None

    @property
    def chosen(self) -> ReplicaScore:
        """The chosen replica's score."""
        return self.ordered[0]


def choose(
    ranked: Sequence[ReplicaScore],
    preference: Mapping[ReplicaId, int],
    rules: ChoiceRules,
    *,
    fallback: Fallback | None,
    sighted: bool,
    sticky: ReplicaId | None,
    sample: Callable[[], float],
    block_size: int = 1,
) -> Choice:
    """Order ``ranked`` by score, or by affinity under a fallback (module docstring).

    ``sighted``: every candidate's event source is live, so a miss means a new prefix.
    ``sticky``: the session's previous replica, preferred under affinity.
    ``block_size``: the unit hits are compared in."""
    unit = max(1, block_size)

    def blocks(s: ReplicaScore) -> int:
        return round(s.expected_cached_tokens / unit)

    best = max(blocks(s) for s in ranked)
    no_hit = fallback is None and best < -(-rules.min_hit_tokens // unit)
    if no_hit and not sighted:
        # The index may just not know: keep sessions where the ring pins them.
        fallback = "no_hit"
    if fallback is not None:
        ordered, overloaded = affinity_order(ranked, preference, rules, sticky)
        reason = "affinity_overload" if overloaded else f"affinity_{fallback}"
        return Choice(ordered, reason, fallback)
    u = sample() if rules.temperature > 0 else 0.0
    ordered = pick(ranked, preference=preference, temperature=rules.temperature, u=u)
    chosen = blocks(ordered[0])
    if no_hit:
        reason = "kv_new"
    elif chosen < best:
        reason = "kv_load"
    elif all(blocks(s) >= chosen for s in ranked):
        reason = "kv_shared"
    else:
        reason = "kv_hit"
    return Choice(ordered, reason, None)


def affinity_order(
    ranked: Sequence[ReplicaScore],
    preference: Mapping[ReplicaId, int],
    rules: ChoiceRules,
    sticky: ReplicaId | None = None,
) -> tuple[list[ReplicaScore], bool]:
    """The session's previous replica (where its cache is, whoever placed it), else
    ring order; unless the pinned replica is overloaded (abs and rel).  Also returns
    whether it was."""
    last = len(preference)
    ordered = sorted(ranked, key=lambda s: (s.replica != sticky,
                                            preference.get(s.replica, last)))
    w = rules.weights

    def cost(s: ReplicaScore) -> float:
        return w.beta * s.queued_prefill_tokens + w.gamma * s.decode_load

    pinned = ordered[0]
    least = min(ordered, key=lambda s: (cost(s), preference.get(s.replica, last)))
    c_pin, c_min = cost(pinned), cost(least)
    if c_pin - c_min > rules.balance_abs_tokens and c_pin > rules.balance_rel * c_min:
        return [least, *(s for s in ordered if s is not least)], True
    return ordered, False
