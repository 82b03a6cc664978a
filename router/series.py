"""Dropping a replica's Prometheus series once it has left the fleet.

Every per-replica series the router exports carries a ``replica`` label.  When a replica
is removed, ``forget_replica(holders, replica)`` walks the metric holders given
(``RouterMetrics``, ``KvMetrics``, ``IndexMetrics``: any object whose attributes are
collectors) and removes every label set whose ``replica`` is that id, so a fleet that
churns does not grow its exposition without bound.  Scrape-time collectors (gauges read
from live state) need nothing: they stop reporting a replica that is gone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

from router.metrics import FastCounter, FastHistogram

__all__ = ["forget_replica"]

_LABEL = "replica"


def forget_replica(holders: Iterable[object], replica: str) -> int:
    """Remove ``replica``'s label sets from every collector of ``holders``; returns how
    many label sets went."""
    removed = 0
    for holder in holders:
        for collector in list(vars(holder).values()):
            if isinstance(collector, FastCounter | FastHistogram):
                removed += _forget_fast(collector, replica)
            elif isinstance(collector, MetricWrapperBase):
                removed += _forget_wrapper(collector, replica)
    return removed


def _forget_fast(family: FastCounter | FastHistogram, replica: str) -> int:
    names: tuple[str, ...] = family._labelnames  # noqa: SLF001 - our own class
    if _LABEL not in names:
        return 0
    i = names.index(_LABEL)
    children: dict[tuple[str, ...], Any] = family._children  # noqa: SLF001
    gone = [values for values in children if values[i] == replica]
    for values in gone:
        del children[values]
    return len(gone)


def _forget_wrapper(metric: MetricWrapperBase, replica: str) -> int:
    # prometheus_client keeps the label names and children on these two attributes
    # (stable since 0.4); ``remove`` is the public way to drop one child.
    names: tuple[str, ...] = tuple(getattr(metric, "_labelnames", ()))
    if _LABEL not in names:
        return 0
    i = names.index(_LABEL)
    children: dict[tuple[str, ...], Any] = getattr(metric, "_metrics", {})
    gone = [values for values in list(children) if values[i] == replica]
    for values in gone:
        metric.remove(*values)
    return len(gone)
