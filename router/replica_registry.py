"""The replicas as seen by the router: identity, health and the models each serves.

``ReplicaRegistry`` is the single source of truth for "who may get traffic".  Health
transitions go through ``record_probe`` (hysteresis: ``fails_to_down`` consecutive
failures mark a replica down, ``successes_to_up`` consecutive successes mark it up; the
very first result is taken as is, so a replica that is down at start-up gets no traffic).
Mutations are synchronous, hence atomic on the event loop.

Models: a replica with ``models is None`` (not configured, not yet discovered) is assumed
to serve any model.  ``candidates(model)`` answers the routing question; it raises
nothing, the proxy turns an empty answer into 404 or 503.

In-flight counts live in ``router.load.LoadTracker`` (``ReplicaState.in_flight`` is not
duplicated here, so there is one counter to keep right).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvkeys.types import ReplicaId
from router.config import ReplicaSettings

__all__ = ["ReplicaRegistry", "ReplicaState"]

HealthListener = Callable[[ReplicaId, bool], None]


@dataclass(slots=True)
class ReplicaState:
    """One replica: mutable health and model state, owned by the registry."""

    id: ReplicaId
    url: str
    healthy: bool = True
    probed: bool = False
    """Whether any probe result has arrived yet."""
    models: tuple[str, ...] | None = None
    """Model ids served (configured, or discovered from ``/v1/models``)."""
    static_models: bool = False
    """Models come from the configuration and are never overwritten by discovery."""
    model_cards: tuple[Mapping[str, Any], ...] = ()
    """The replica's ``/v1/models`` cards, as last read."""
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    settings: ReplicaSettings | None = field(default=None, repr=False)

    def serves(self, model: str | None) -> bool:
        """Whether this replica can take a request for ``model``."""
        return model is None or self.models is None or model in self.models


class ReplicaRegistry:
    """The configured replicas and their state."""

    def __init__(
        self,
        replicas: Iterable[ReplicaSettings],
        *,
        fails_to_down: int = 2,
        successes_to_up: int = 2,
    ) -> None:
        self._fails_to_down = fails_to_down
        self._successes_to_up = successes_to_up
        self._by_id: dict[ReplicaId, ReplicaState] = {}
        for rs in replicas:
            rid = ReplicaId(rs.id)
            self._by_id[rid] = ReplicaState(
                id=rid,
                url=rs.url,
                models=tuple(rs.models) if rs.models is not None else None,
                static_models=rs.models is not None,
                settings=rs,
            )
        self._ids = tuple(self._by_id)
        self._healthy: tuple[ReplicaId, ...] = self._ids
        self._listeners: list[HealthListener] = []

    @property
    def ids(self) -> tuple[ReplicaId, ...]:
        """Every replica id, in configuration order."""
        return self._ids

    def __getitem__(self, replica: ReplicaId) -> ReplicaState:
        return self._by_id[replica]

    def __iter__(self) -> Iterable[ReplicaState]:  # type: ignore[override]
        return iter(self._by_id.values())

    def all(self) -> Sequence[ReplicaState]:
        """Every replica state, in configuration order."""
        return tuple(self._by_id.values())

    def healthy_ids(self) -> tuple[ReplicaId, ...]:
        """Replicas that may get traffic now (cached tuple, cheap)."""
        return self._healthy

    def on_health_change(self, listener: HealthListener) -> None:
        """Call ``listener(replica, healthy)`` on every transition (e.g. to clear an index)."""
        self._listeners.append(listener)

    def candidates(self, model: str | None) -> tuple[tuple[ReplicaId, ...], bool]:
        """``(healthy replicas serving model, whether any replica serves it at all)``."""
        if model is None:
            return self._healthy, bool(self._ids)
        healthy: list[ReplicaId] = []
        known = False
        for state in self._by_id.values():
            if state.serves(model):
                known = True
                if state.healthy:
                    healthy.append(state.id)
        return tuple(healthy), known

    def record_probe(self, replica: ReplicaId, ok: bool) -> bool | None:
        """Apply one probe result; returns the new health on a transition, else ``None``."""
        state = self._by_id[replica]
        if ok:
            state.consecutive_failures = 0
            state.consecutive_successes += 1
            flip = not state.healthy and (
                not state.probed or state.consecutive_successes >= self._successes_to_up
            )
        else:
            state.consecutive_successes = 0
            state.consecutive_failures += 1
            flip = state.healthy and (
                not state.probed or state.consecutive_failures >= self._fails_to_down
            )
        state.probed = True
        if not flip:
            return None
        state.healthy = ok
        self._healthy = tuple(r for r, s in self._by_id.items() if s.healthy)
        for listener in self._listeners:
            listener(replica, ok)
        return ok

    def set_models(self, replica: ReplicaId, cards: Sequence[Mapping[str, Any]]) -> None:
        """Store what ``/v1/models`` returned (configured model lists are kept)."""
        state = self._by_id[replica]
        state.model_cards = tuple(cards)
        if not state.static_models:
            state.models = tuple(str(c["id"]) for c in cards if "id" in c)

    def model_cards(self) -> list[Mapping[str, Any]]:
        """The union of the healthy replicas' model cards, first replica's card wins."""
        out: dict[str, Mapping[str, Any]] = {}
        for state in self._by_id.values():
            if not state.healthy:
                continue
            for card in state.model_cards:
                out.setdefault(str(card.get("id")), card)
            for model in state.models or ():
                out.setdefault(model, {"id": model, "object": "model", "owned_by": "kvroute"})
        return list(out.values())
