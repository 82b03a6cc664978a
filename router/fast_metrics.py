"""Labelled counters and histograms for the hot path: ``FastCounter`` / ``FastHistogram``.

The same exposition as ``prometheus_client``'s ``Counter`` and ``Histogram`` (``_total``,
``_bucket``, ``_sum``, ``_count``, ``_created``), without the per-update lock and checks
(about a microsecond per update there, five times per request).  They are safe because
the router is one thread on one event loop: updates and scrapes never run concurrently.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["FastCounter", "FastHistogram"]

_C = TypeVar("_C")


class _Family(Generic[_C]):
    """What both fast families share: the name, the label names and one child per label
    set, created on first use by ``_new_child``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _C] = {}
        registry.register(self)

    def _new_child(self) -> _C:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        """The exposition (``prometheus_client``'s collector interface)."""
        raise NotImplementedError

    def labels(self, *values: str) -> _C:
        """The child for one label set (created empty on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(
                    f"{self._name}: expected labels {self._labelnames}, got {values}"
                )
            child = self._children[values] = self._new_child()
        return child


class _CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (callers pass non-negative amounts)."""
        self.value += amount


class FastCounter(_Family[_CounterChild]):
    """A labelled counter for the hot path: ``labels(*values).inc()``, exported like
    ``prometheus_client.Counter`` (``name_total`` and ``name_created`` per label set)."""

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        """Per bucket (not cumulative): ``counts[i]`` observations in (bound[i-1], bound[i]]."""
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Record one observation."""
        self.sum += amount
        self.counts[bisect_left(self._bounds, amount)] += 1


class FastHistogram(_Family[_HistogramChild]):
    """A labelled histogram for the hot path: ``labels(*values).observe(v)``, exported like
    ``prometheus_client.Histogram`` (cumulative ``le`` buckets with ``+Inf``, ``_count``,
    ``_sum``, ``_created``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, *, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._bounds = tuple(bounds)
        self._les = tuple(_le(b) for b in bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in list(self._children.items()):
            total = 0.0
            cumulative: list[tuple[str, float]] = []
            for le, count in zip(self._les, child.counts, strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(values, cumulative, child.sum)
            family.samples.append(Sample(self._name + "_created",
                                         dict(zip(self._labelnames, values, strict=True)),
                                         child.created, None, None))
        yield family


def _le(bound: float) -> str:
    """A bucket bound as ``prometheus_client`` writes it (``0.001``, ``1.0``, ``+Inf``)."""
    text: str = floatToGoString(bound)  # type: ignore[no-untyped-call]  # untyped upstream
    return text
