"""Decoding is tolerant where vLLM versions differ and strict where payloads are garbage."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClearedEvent,
    KVEventBatch,
    RemovedEvent,
    StoredEvent,
    UndecodableBatch,
    _decode_tolerant,
    _fast,
    _FastStored,
    decode_batch,
    encode_batch,
    normalise_hash,
)
from kvkeys.types import EngineKey, Medium

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


# The fast (typed) decoder and the tolerant one must agree wherever the fast one accepts.
_hash = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1),
                  st.binary(min_size=1, max_size=32))  # fmt: skip
_medium = st.one_of(st.none(), st.sampled_from(["GPU", "cpu", "STORAGE", "CXL"]), st.integers(0, 9))
_stored_map = st.fixed_dictionaries(
    {"type": st.just("BlockStored"), "block_hashes": st.lists(_hash, max_size=4)},
    optional={
        "parent_block_hash": st.one_of(st.none(), _hash),
        "token_ids": st.lists(st.integers(0, 2**20), max_size=8),
        "block_size": st.integers(0, 4),
        "lora_id": st.one_of(st.none(), st.integers(0, 3)),
        "medium": _medium,
        "lora_name": st.one_of(st.none(), st.text(max_size=3)),
        "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=2), max_size=2)), max_size=2)),  # noqa: E501
        "group_idx": st.one_of(st.none(), st.integers(0, 2)),
        "kv_cache_spec_kind": st.one_of(st.none(), st.sampled_from(["full_attention", "x"])),
        "something_new": st.integers(-(2**63), 2**64 - 1),
    },
)
_removed_map = st.fixed_dictionaries(
    {"type": st.just("BlockRemoved"), "block_hashes": st.lists(_hash, max_size=4)},
    optional={"medium": _medium, "group_idx": st.one_of(st.none(), st.integers(0, 2))},
)
_event = st.one_of(
    _stored_map, _removed_map, st.just({"type": "AllBlocksCleared"}),
    st.just({"type": "BlocksPinned", "block_hashes": [1]}),
    st.tuples(st.just("BlockRemoved"), st.lists(_hash, max_size=3)).map(list),
)  # fmt: skip
_batch = st.tuples(
    st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40)),
    st.lists(_event, max_size=5),
    st.one_of(st.none(), st.integers(0, 4)),
).map(list)


@settings(max_examples=400, deadline=None)
@given(_batch)
def test_fast_and_tolerant_decoders_agree(batch: list[object]) -> None:
    payload = enc(batch)
    try:
        want = _decode_tolerant(payload)
    except UndecodableBatch:
        with pytest.raises(UndecodableBatch):
            decode_batch(payload)
        return
    assert decode_batch(payload) == want


def test_the_fast_decoder_takes_vllm_s_default_batches() -> None:
    # The shape vLLM 0.32 publishes by default must not fall back (it is the hot path).
    payload = encode_batch(KVEventBatch(1.5, [
        BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, None, "GPU", None),
        BlockRemoved([7], "GPU"), AllBlocksCleared(),
    ], 0))  # fmt: skip
    first = _fast.decode(payload).events[0]
    assert isinstance(first, _FastStored) and first.block_hashes == [2**64 - 1, 7]
    assert decode_batch(payload) == _decode_tolerant(payload)
