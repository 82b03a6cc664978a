"""``GET /ready``: whether this router should take traffic, and what is degraded.

The answer is 200 while at least one replica is healthy, else 503.  The body says
what works and what does not::

    {"ready": true, "worker": 0, "healthy_replicas": ["a", "b"], "degraded": ["kv_events"],
     "kv_events": {"ok": false, "failing": {"kv:a": "RuntimeError: ..."},
                   "restarts": {"kv:a": 3}, "sources": {"a": "live", "b": "live"},
                   "connected": 2},
     "background_tasks": {"ok": true, "failing": {}, "restarts": {}}}

* ``worker`` is the answering process's index under ``kvroute serve --workers N`` (0 for
  a single process): each worker has its own index and sources, so a client that must
  know them all live polls on fresh connections until it has heard from every worker.
* ``kv_events.ok`` is false while KV event ingestion is down: its task, or one of its
  sources' subscribers, failed within the supervisor's ``healthy_after_s`` (each is
  restarted with backoff, ``aio.task_owner`` and ``aio.supervisor``).  ``sources`` gives
  each event source's state (``index.status``) and ``connected`` how many streams are up.
* ``background_tasks.ok`` is false while a supervised loop (health prober, scraper,
  gauges) failed recently.
* ``degraded`` lists the parts that are not ok.  The router still routes without KV
  information (affinity), so by default this does not turn ``/ready`` into 503, which
  would take every router of a fleet out of service at once when they all meet the
  same bad event stream; ``readiness.require_kv_events: true`` makes it 503.

The same facts are metrics: ``router_kv_events_ingestion_up``,
``router_kv_events_source_restarts_total``, ``router_background_task_restarts_total`` and
``router_background_tasks_failing``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from aio.task_owner import TaskOwner
from router.config import RouterSettings
from router.replica_registry import ReplicaRegistry

__all__ = ["TaskCollector", "readiness"]

_KV_TASK = "kv-events"


def readiness(
    settings: RouterSettings,
    replicas: ReplicaRegistry,
    tasks: TaskOwner,
    services: Mapping[str, Any],
    *,
    worker: int = 0,
) -> tuple[int, dict[str, Any]]:
    """The status code and JSON body of ``GET /ready`` (see the module docstring)."""
    healthy = replicas.healthy_ids()
    task_health = tasks.health()
    body: dict[str, Any] = {"ready": bool(healthy), "worker": worker,
                            "healthy_replicas": list(healthy)}
    degraded: list[str] = []
    kv = services.get("kv")
    detail = getattr(kv, "readiness", None)
    if callable(detail):
        kv_detail: dict[str, Any] = detail()
        if _KV_TASK in task_health.failing:
            kv_detail["ok"] = False
            kv_detail["failing"] = {**kv_detail.get("failing", {}),
                                    _KV_TASK: task_health.failing[_KV_TASK]}  # fmt: skip
        body["kv_events"] = kv_detail
        if not kv_detail["ok"]:
            degraded.append("kv_events")
    others = {k: v for k, v in task_health.failing.items() if k != _KV_TASK}
    body["background_tasks"] = {"ok": not others, "failing": others,
                                "restarts": task_health.restarts}  # fmt: skip
    if others:
        degraded.append("background_tasks")
    body["degraded"] = degraded
    ready = bool(healthy) and not (
        "kv_events" in degraded and settings.readiness.require_kv_events
    )
    body["ready"] = ready
    return (200 if ready else 503), body


class TaskCollector:
    """Exports the supervised background tasks' restarts and recent failures
    (``router_background_task_restarts_total{task}``, ``router_background_tasks_failing``),
    read at scrape time."""

    def __init__(self, owner: TaskOwner) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        health = self._owner.health()
        restarts = CounterMetricFamily(
            "router_background_task_restarts",
            "Background tasks that failed and were restarted with backoff.",
            labels=["task"],
        )
        for name, count in sorted(health.restarts.items()):
            restarts.add_metric([name], count)
        yield restarts
        yield GaugeMetricFamily(
            "router_background_tasks_failing",
            "Background tasks that failed recently (restarted, or waiting to restart).",
            value=len(health.failing),
        )
