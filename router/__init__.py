"""``router``: the HTTP surface of kvroute, replicas as the router sees them, policies,
metrics, configuration and CLI.

Public names are re-exported lazily (``kvroute --help`` must not import uvicorn, aiohttp
or prometheus): ``from router import create_app`` works and costs the import only then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.app import State, create_app
    from router.config import ConfigError, RouterSettings
    from router.load import LoadTracker, ReplicaLoad
    from router.plugins import PolicyContext, PolicyFactory, PolicyRegistry, Service
    from router.policy import Decision, Policy, Receipt, RouteRequest
    from router.replica_registry import ReplicaRegistry, ReplicaState

__all__ = [
    "ConfigError",
    "Decision",
    "LoadTracker",
    "Policy",
    "PolicyContext",
    "PolicyFactory",
    "PolicyRegistry",
    "Receipt",
    "ReplicaLoad",
    "ReplicaRegistry",
    "ReplicaState",
    "RouteRequest",
    "RouterSettings",
    "Service",
    "State",
    "create_app",
]

_WHERE = {
    "State": "router.app", "create_app": "router.app",
    
    "ConfigError": "router.config", "RouterSettings": "router.config",
    "LoadTracker": "router.load", "ReplicaLoad": "router.load",
    "PolicyContext": "router.plugins", "PolicyFactory": "router.plugins",
    "PolicyRegistry": "router.plugins", "Service": "router.plugins",
    "Decision": "router.policy", "Policy": "router.policy", "Receipt": "router.policy",
    "RouteRequest": "router.policy",
    "ReplicaRegistry": "router.replica_registry", "ReplicaState": "router.replica_registry",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
