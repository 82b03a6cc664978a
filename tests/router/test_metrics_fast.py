"""``FastCounter`` / ``FastHistogram`` export exactly what ``prometheus_client``'s
``Counter`` / ``Histogram`` would for the same updates (the ``_created`` times aside)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from router.metrics import FastCounter, FastHistogram

BUCKETS = (0.001, 0.0025, 0.01, 0.5, 1.0, 60.0)
OBSERVED = (0.0, 0.001, 0.0011, 0.003, 0.5, 0.75, 1.0, 59.0, 61.0, 1e9)


def _without_created(text: bytes) -> str:
    return re.sub(r"^(\S+_created\S*) \S+$", r"\1 T", text.decode(), flags=re.M)


@pytest.mark.parametrize("render", [generate_latest, generate_openmetrics])
def test_same_exposition_as_prometheus_client(
    render: Callable[[CollectorRegistry], bytes],
) -> None:
    native, fast = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("x_requests_total", "Requests.", ["endpoint", "status"], registry=native)
    c2 = FastCounter("x_requests_total", "Requests.", ["endpoint", "status"], fast)
    h1 = Histogram("x_ttfb_seconds", "TTFB.", ["replica"], buckets=BUCKETS, registry=native)
    h2 = FastHistogram("x_ttfb_seconds", "TTFB.", ["replica"], fast, buckets=BUCKETS)
    assert _without_created(render(native)) == _without_created(render(fast))  # no children
    for c in (c1, c2):
        c.labels("chat", "200").inc()
        c.labels("chat", "200").inc(2.5)
        c.labels("other", "502").inc()
    for h in (h1, h2):
        for i, v in enumerate(OBSERVED):
            h.labels("r1" if i % 3 else "r2").observe(v)
    assert _without_created(render(native)) == _without_created(render(fast))
    assert b"x_ttfb_seconds_created" in render(fast)


def test_names_are_registered_and_labels_checked() -> None:
    registry = CollectorRegistry()
    counter = FastCounter("y_total", "Y.", ["a"], registry)
    with pytest.raises(ValueError):
        FastCounter("y_total", "Y again.", ["a"], registry)  # duplicate name
    with pytest.raises(ValueError):
        counter.labels("1", "2")
    histogram = FastHistogram("z_seconds", "Z.", [], registry, buckets=(1.0,))
    histogram.labels().observe(2.0)
    text = generate_latest(registry).decode()
    assert 'z_seconds_bucket{le="1.0"} 0.0' in text and 'z_seconds_bucket{le="+Inf"} 1.0' in text
    registry.unregister(counter)
    registry.unregister(histogram)
    assert "y_total" not in generate_latest(registry).decode()


@pytest.mark.parametrize("render", [generate_latest, generate_openmetrics])
def test_unlabelled_families_with_their_child_export_what_prometheus_client_does(
    render: Callable[[CollectorRegistry], bytes],
) -> None:
    """An unlabelled ``FastCounter`` / ``FastHistogram`` whose child is made at once (as
    ``KvMetrics`` does) exports the same as the unlabelled ``prometheus_client`` series,
    before and after updates."""
    native, fast = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("x_lost_tokens_total", "Lost.", registry=native)
    c2 = FastCounter("x_lost_tokens_total", "Lost.", [], fast)
    h1 = Histogram("x_think_seconds", "Think.", buckets=BUCKETS, registry=native)
    h2 = FastHistogram("x_think_seconds", "Think.", [], fast, buckets=BUCKETS)
    c2.labels()
    h2.labels()
    assert _without_created(render(native)) == _without_created(render(fast))
    for v in OBSERVED:
        c1.inc(v)
        c2.labels().inc(v)
        h1.observe(v)
        h2.labels().observe(v)
    assert _without_created(render(native)) == _without_created(render(fast))
