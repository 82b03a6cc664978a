"""A replayed policy with some of its settings changed: ``kv/pool_headroom=false``.

``kvroute replay --policies`` takes built-in policy names, and each may carry
``/key=value`` overrides of the router's scoring settings (``ScoringSettings``, the
``scoring`` section of the router's configuration; a dotted key reaches a nested one,
``scrape.interval_s``).  A value is read as JSON where it parses (``false``, ``0.9``,
``null``) and as a string otherwise, then validated as the router validates its
configuration: an unknown key or a value of the wrong type is refused before anything
runs.  The spec as written is the policy's label in every table and in the JSON, so
``kv`` and ``kv/price_future=false`` run side by side on the same workload and namings:
what one term of the policy is worth, measured in place (an ablation).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvroute.replay.loop import POLICIES, ReplayConfig
from router.config_scoring import ScoringSettings

__all__ = ["PolicySpec", "parse_policy"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One ``--policies`` entry: the label as written, the policy and its overrides."""

    label: str
    name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    """``(dotted key, value)`` pairs, in the order written."""

    def config(self, cfg: ReplayConfig) -> ReplayConfig:
        """``cfg`` with this policy's scoring overrides applied (validated)."""
        if not self.overrides:
            return cfg
        return dataclasses.replace(cfg, scoring=_scoring(cfg.scoring, self.overrides))


def parse_policy(spec: str) -> PolicySpec:
    """``name`` or ``name/key=value/...`` (module docstring); ``ValueError`` names what
    is wrong."""
    name, *parts = spec.strip().split("/")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} in {spec!r}; "
                         f"choose from {', '.join(POLICIES)}")
    overrides = []
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key or any(not k for k in key.split(".")):
            raise ValueError(f"not a key=value override: {part!r} in {spec!r}")
        overrides.append((key, _value(raw)))
    found = PolicySpec(spec.strip(), name, tuple(overrides))
    found.config(ReplayConfig())  # refused here, before any replay, if invalid
    return found


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _scoring(base: ScoringSettings, overrides: tuple[tuple[str, Any], ...]) -> ScoringSettings:
    data = base.model_dump()
    for key, value in overrides:
        *path, leaf = key.split(".")
        node = data
        for k in path:
            child = node.get(k)
            if not isinstance(child, dict):
                raise ValueError(f"no scoring section {key.rsplit('.', 1)[0]!r}")
            node = child
        node[leaf] = value
    try:
        return ScoringSettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(f"scoring override refused: {problems}") from None
