"""``router.__all__`` is the public surface, and every name resolves."""

from __future__ import annotations

import router


def test_exported_members() -> None:
    assert router.__all__ == sorted(router.__all__)
    assert set(router.__all__) == {
        "ConfigError", "Decision", "LoadTracker", "Policy", "PolicyContext",
        "PolicyFactory", "PolicyRegistry", "Receipt", "ReplicaLoad", "ReplicaRegistry",
        "ReplicaState", "RouteRequest", "RouterSettings", "Service", "State", "create_app",
    }
    for name in router.__all__:
        assert getattr(router, name) is not None
