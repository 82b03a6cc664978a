"""Decoding is tolerant where vLLM versions differ and strict where payloads are garbage."""

from __future__ import annotations

import msgspec
import pytest

from index.events import (
    ClearedEvent,
    RemovedEvent,
    StoredEvent,
    UndecodableBatch,
    decode_batch,
    normalise_hash,
)
from index.types import EngineKey, Medium

enc = msgspec.msgpack.encode


def test_oldest_array_layouts_decode_by_length() -> None:
    # vLLM 0.9: [tag, hashes, parent, tokens, block_size, lora_id]; BlockRemoved [tag, hashes].
    payload = enc([3.0, [["BlockStored", [1, 2], 9, [1, 2, 3, 4], 2, None],
                         ["BlockRemoved", [1]], ["AllBlocksCleared"]], None])  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events == [
        StoredEvent([EngineKey(1), EngineKey(2)], EngineKey(9), [1, 2, 3, 4], 2, Medium.GPU),
        RemovedEvent([EngineKey(1)], Medium.GPU),
        ClearedEvent(),
    ]


def test_signed_hashes_of_old_versions_are_taken_modulo_2_64() -> None:
    batch = decode_batch(enc([0.0, [["BlockRemoved", [-1, -(2**63)]]]]))
    ev = batch.events[0]
    assert isinstance(ev, RemovedEvent)
    assert ev.block_hashes == [2**64 - 1, 2**63]
    assert normalise_hash(b"\x01" * 32) == int.from_bytes(b"\x01" * 8, "big")
    assert normalise_hash(b"\x05") == 5


def test_unknown_fields_and_tags_are_ignored() -> None:
    payload = enc([1.0, [
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "Cpu",
         "lora_name": None, "something_new": {"x": 1}, "lookahead_token_ids": [[3]]},
        {"type": "BlocksPinned", "block_hashes": [5]},
        ["FutureEvent", 1, 2],
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "CXL", "group_idx": 0},
    ], 1, "extra outer element"])  # fmt: skip
    batch = decode_batch(payload)
    assert batch.ignored == 2
    assert batch.data_parallel_rank == 1
    stored, removed = batch.events
    assert isinstance(stored, StoredEvent) and stored.medium is Medium.CPU
    assert isinstance(removed, RemovedEvent) and removed.medium is Medium.STORAGE


def test_medium_none_means_gpu_and_missing_rank_is_none() -> None:
    batch = decode_batch(enc([1, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None}]]))
    assert batch.events == [RemovedEvent([EngineKey(1)], Medium.GPU)]
    assert batch.data_parallel_rank is None and batch.ts == 1.0


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        enc({"ts": 1, "events": []}),
        enc([1.0]),
        enc(["x", []]),
        enc([True, []]),
        enc([1.0, "events"]),
        enc([1.0, [], "rank"]),
        enc([1.0, [42]]),
        enc([1.0, [{"type": "BlockStored", "block_hashes": "nope"}]]),
        enc([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]),
        enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]}]]),
        enc([1.0, [{"type": "BlockRemoved"}]]),
        enc([1.0, [["BlockRemoved", [1], 7]]]),
    ],
)
def test_poison_pills_raise_undecodable(payload: bytes) -> None:
    with pytest.raises(UndecodableBatch):
        decode_batch(payload)
