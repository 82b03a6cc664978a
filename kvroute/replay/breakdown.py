"""Where one policy's cached tokens differ from a baseline's on the same turns.

Every turn of a replay is served under each policy (the workload's replies are fixed, so
turn N's prompt is the same whatever routed turn N-1).  Joining the policy's run with the
baseline's by (session, turn) and grouping the policy's turns by what it did (``first``
turn, ``stay`` on the previous turn's replica, ``move``) and why (the decision's reason)
shows which decisions gain or lose cached tokens against, say, session affinity: the
instrument behind the policy work (``kvroute replay --breakdown session``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvroute.replay.loop import Served

__all__ = ["BreakdownRow", "breakdown", "format_breakdown"]


@dataclass(frozen=True, slots=True)
class BreakdownRow:
    """The policy's turns of one kind and reason, against the baseline's same turns."""

    kind: str
    """``first`` (a conversation's first turn), ``stay`` or ``move``."""
    reason: str
    turns: int
    cached_tokens: int
    baseline_cached_tokens: int
    prompt_tokens: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _kind(s: Served) -> str:
    if s.previous_replica is None:
        return "first"
    return "stay" if s.replica == s.previous_replica else "move"


def breakdown(served: Sequence[Served], baseline: Sequence[Served]) -> list[BreakdownRow]:
    """The rows, by kind then reason; turns that failed in either run are left out."""
    base = {(s.session, s.turn): s for s in baseline if s.ok}
    groups: dict[tuple[str, str], list[int]] = {}
    for s in served:
        b = base.get((s.session, s.turn))
        if b is None or not s.ok:
            continue
        g = groups.setdefault((_kind(s), s.reason or "-"), [0, 0, 0, 0])
        g[0] += 1
        g[1] += s.cached_tokens
        g[2] += b.cached_tokens
        g[3] += s.prompt_tokens
    return [BreakdownRow(kind, reason, *g) for (kind, reason), g in sorted(groups.items())]


def format_breakdown(policy: str, baseline: str, rows: Sequence[BreakdownRow],
                     total_prompt_tokens: int) -> str:  # fmt: skip
    """A Markdown table: each row's cached tokens under both policies and the difference
    in points of all prompt tokens."""
    total = max(1, total_prompt_tokens)
    lines = [f"{policy} against {baseline}, turn by turn:", "",
             f"| turns | reason | count | {policy} cached | {baseline} cached | difference |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        diff = 100 * (r.cached_tokens - r.baseline_cached_tokens) / total
        lines.append(f"| {r.kind} | {r.reason} | {r.turns} | {r.cached_tokens:,} | "
                     f"{r.baseline_cached_tokens:,} | {diff:+.2f} points |")
    return "\n".join(lines)
