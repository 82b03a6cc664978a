"""``MemberIngestion``: per-replica ingestion that follows the fleet (a real ZMQ context;
the endpoints need not answer, a SUB connects lazily)."""

from __future__ import annotations

import asyncio

from aio.task_owner import TaskOwner
from index.ingestion import SourceSpec
from index.memory import InMemoryIndex
from kvkeys.types import EngineKey, ReplicaId, RequestKey
from router.kv_members import MemberIngestion
from tests.ports import free_port

R0, R1 = ReplicaId("r0"), ReplicaId("r1")


def spec(replica: ReplicaId) -> SourceSpec:
    return SourceSpec(replica, model="m", endpoint=f"tcp://127.0.0.1:{free_port()}")


async def test_removal_stops_ingestion_clears_the_entries_and_a_rejoin_waits_for_it() -> None:
    index = InMemoryIndex()
    async with TaskOwner() as tasks:
        members = MemberIngestion(index, tasks=tasks, http=None)
        try:
            members.add(spec(R0))
            members.add(spec(R1))
            await asyncio.sleep(0.3)  # the subscribers' start-up clear is done
            await index.add(R0, [EngineKey(1)], [RequestKey(11)])
            await index.add(R1, [EngineKey(2)], [RequestKey(22)])
            forgotten: list[str] = []
            leaving = members.remove(R0, then=lambda: forgotten.append("r0"))
            assert R0 not in members
            members.add(spec(R0))  # back at once: added only once its entries are gone
            assert R0 not in members
            await leaving
            assert forgotten == ["r0"] and R0 not in await index.replicas()
            for _ in range(20):
                if R0 in members:
                    break
                await asyncio.sleep(0.01)
            assert R0 in members and R1 in members
        finally:
            await members.aclose()
        assert members.closed
        members.add(spec(R0))  # after close: nothing starts
        assert R0 not in members
