"""Faults the simulated replica can be told to show, for tests of the router.

``Faults`` is a mutable record owned by one server; ``POST /sim/faults`` (JSON with any
of the fields below) and the ``--fault-*`` flags set it, ``GET /sim/faults`` reads it.

* ``crash``: the replica dies at once (the CLI process exits with status 17; an
  in-process server closes its listener and every connection).
* ``hang``: requests are accepted and never answered; ``/health`` hangs too.
* ``slow_first_token_s``: wall seconds added before a generation's first byte.
* ``error_status`` / ``error_count``: answer generation requests with this HTTP status
  (vLLM's error body), ``error_count`` times (``None``: until cleared).
* ``drop_events``: the next N event batches are not sent live (they stay in the replay
  buffer, so a subscriber sees a sequence gap it can fill by replay).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


class FaultSpecError(ValueError):
    """A fault request named an unknown field or gave a bad value."""


@dataclass(slots=True)
class Faults:
    """Current fault settings of one simulated replica."""

    crash: bool = False
    hang: bool = False
    slow_first_token_s: float = 0.0
    error_status: int | None = None
    error_count: int | None = None
    drop_events: int = 0

    def update(self, spec: Mapping[str, Any]) -> None:
        """Apply a partial update (``POST /sim/faults``)."""
        for name, value in spec.items():
            if name in ("crash", "hang"):
                if not isinstance(value, bool):
                    raise FaultSpecError(f"{name} must be a boolean")
            elif name == "slow_first_token_s":
                if not isinstance(value, int | float) or value < 0:
                    raise FaultSpecError("slow_first_token_s must be a number >= 0")
                value = float(value)
            elif name == "error_status":
                if value is not None and (not isinstance(value, int) or not 400 <= value <= 599):
                    raise FaultSpecError("error_status must be an HTTP error status or null")
            elif name == "error_count":
                if value is not None and (not isinstance(value, int) or value < 0):
                    raise FaultSpecError("error_count must be an integer >= 0 or null")
            elif name == "drop_events":
                if not isinstance(value, int) or value < 0:
                    raise FaultSpecError("drop_events must be an integer >= 0")
            else:
                raise FaultSpecError(f"unknown fault {name!r}")
            setattr(self, name, value)

    def take_error(self) -> int | None:
        """The status to fail the next generation request with, if any (consumes one)."""
        if self.error_status is None:
            return None
        if self.error_count is not None:
            if self.error_count <= 0:
                self.error_status = None
                self.error_count = None
                return None
            self.error_count -= 1
        return self.error_status

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)
