"""``replica.sim.__all__`` and ``replica.vllm.__all__`` are their public surfaces, and every
name resolves to what it names."""

from __future__ import annotations

import replica.sim
import replica.vllm


def test_sim_exported_members() -> None:
    assert replica.sim.__all__ == sorted(replica.sim.__all__)
    assert set(replica.sim.__all__) == {
        "BlockPool", "EngineConfig", "Faults", "KVEventPublisher", "SimEngine", "SimServer",
        "SimSettings",
    }
    for name in replica.sim.__all__:
        assert getattr(replica.sim, name).__name__ == name


def test_vllm_exported_members() -> None:
    assert replica.vllm.__all__ == sorted(replica.vllm.__all__)
    assert set(replica.vllm.__all__) == {"VllmReplicaSpec", "build_command", "launch"}
    for name in replica.vllm.__all__:
        assert getattr(replica.vllm, name).__name__ == name
