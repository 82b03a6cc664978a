"""``replica.sim``: a simulated vLLM V1 replica (block pool, scheduler, engine, HTTP server,
KV events), faithful to vLLM 0.32's interfaces, in simulated time."""

from __future__ import annotations

from replica.sim.block_pool import BlockPool
from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.faults import Faults
from replica.sim.kv_publisher import KVEventPublisher
from replica.sim.server import SimServer, SimSettings

__all__ = [
    "BlockPool",
    "EngineConfig",
    "Faults",
    "KVEventPublisher",
    "SimEngine",
    "SimServer",
    "SimSettings",
]
