"""The policies and services ``kvroute serve`` knows by name: the lists to edit when a
component ships (``router.plugins`` defines what a factory and a service are)."""

from __future__ import annotations

from router.config import RouterSettings
from router.kv_services import kv_factory, kv_service, session_factory
from router.load_policies import LeastLoaded, RandomPolicy, RoundRobin
from router.plugins import PolicyFactory, Service

__all__ = ["builtin_policy_factories", "builtin_services"]


def builtin_policy_factories() -> dict[str, PolicyFactory]:
    """The policies ``kvroute serve`` knows by name."""
    return {
        "round_robin": RoundRobin.factory,
        "least_loaded": LeastLoaded.factory,
        "random": RandomPolicy.factory,
        "session": session_factory,
        "kv": kv_factory,
    }


def builtin_services(settings: RouterSettings) -> list[Service]:
    """The services ``kvroute serve`` starts: the KV routing stack (renderers, index,
    KV-event ingestion, ``/metrics`` scraper), used by the ``kv`` policy."""
    return [kv_service()]
