"""``KVEventIngestion.status``: one source's snapshot, as ``statuses()`` reports it."""

from __future__ import annotations

import itertools

from index.ingestion import KVEventIngestion, LeaseSettings
from index.memory import InMemoryIndex
from index.status import SourceStatus
from kvkeys.types import ReplicaId

R = [ReplicaId(f"r{i}") for i in range(3)]


def test_one_status_is_the_one_of_every_status() -> None:
    """Local and published snapshots, owned or not, with and without a lease: the direct
    lookup answers what ``statuses()`` holds for the replica."""
    ing = KVEventIngestion(InMemoryIndex())
    lease = LeaseSettings(client=None)  # type: ignore[arg-type]  # never connected here
    masks = list(itertools.product([False, True], repeat=len(R)))
    for (local, remote, owned), leased in itertools.product(
            itertools.product(masks, repeat=3), (False, True)):  # fmt: skip
        ing._local = {r: SourceStatus(r, "local", None) for r in _on(local)}
        ing._remote = {r: SourceStatus(r, "remote", None) for r in _on(remote)}
        ing._owned = set(_on(owned))
        ing._lease = lease if leased else None
        every = ing.statuses()
        for r in [*R, ReplicaId("unknown")]:
            assert ing.status(r) is every.get(r)


def _on(mask: tuple[bool, ...]) -> list[ReplicaId]:
    return [r for r, on in zip(R, mask, strict=True) if on]
