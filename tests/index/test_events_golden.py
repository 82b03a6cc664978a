"""``index.events`` against payloads captured from the real vLLM 0.32 classes.

The bytes in ``golden/`` were written by ``golden/make_golden.py`` (run with vLLM's own
``KVEventBatch`` / ``BlockStored`` / ...); these tests need no vLLM.  The wire structs
built here use the same values as ``make_golden.py``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClearedEvent,
    KVEventBatch,
    RemovedEvent,
    StoredEvent,
    decode_batch,
    encode_batch,
    encode_batch_legacy,
)
from kvkeys.types import EngineKey, Medium

GOLDEN = Path(__file__).parent / "golden"
U = 0x1122334455667788
BIG = 0xF0E1D2C3B4A59687


def cases() -> dict[str, KVEventBatch]:
    return {
        "basic": KVEventBatch(
            ts=1.5,
            events=[
                BlockStored([U, BIG], None, [1, 2, 3, 4], 2, None, "GPU", None,
                            extra_keys=[("salt-1",), None], group_idx=0,
                            kv_cache_spec_kind="full_attention"),
                BlockStored([7], BIG, [5, 6], 2, None, "GPU", None, extra_keys=[None],
                            group_idx=0, kv_cache_spec_kind="full_attention"),
                BlockRemoved([U], "GPU", group_idx=0),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        ),
        "bytes_hashes": KVEventBatch(
            ts=1700000000.25,
            events=[
                BlockStored([bytes(range(32)), bytes(range(32, 64))], bytes(range(64, 96)),
                            [9] * 8, 4, None, "cpu", None),
                BlockRemoved([bytes(range(32))], "CPU"),
            ],
            data_parallel_rank=None,
        ),
        "lora_offload": KVEventBatch(
            ts=2.0,
            events=[
                BlockStored([11, 12], None, [1, 2, 3, 4], 2, 3, "GPU", "adapter",
                            extra_keys=[("adapter", "tenant-salt"), ("adapter",)], group_idx=0,
                            kv_cache_spec_kind="full_attention", locality="LOCAL",
                            session_id="s1"),
                BlockStored([12], None, [], 0, None, "CPU", None, group_idx=0,
                            locality="LOCAL", ownership="tier-1"),
                BlockStored([21], None, [1, 2], 2, None, "GPU", None, group_idx=1,
                            kv_cache_spec_kind="sliding_window",
                            kv_cache_spec_sliding_window=128),
                BlockRemoved([11, 12], "GPU", group_idx=0, locality="LOCAL"),
            ],
            data_parallel_rank=2,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(cases()))
def test_encoder_reproduces_vllm_bytes(name: str) -> None:
    golden = (GOLDEN / f"v032_{name}.msgpack").read_bytes()
    assert encode_batch(cases()[name]) == golden


@pytest.mark.parametrize("name", sorted(cases()))
def test_legacy_encoder_reproduces_tagged_arrays(name: str) -> None:
    golden = (GOLDEN / f"legacy_{name}.msgpack").read_bytes()
    assert encode_batch_legacy(cases()[name]) == golden
    # The legacy form really is positional arrays with the tag first.
    raw = msgspec.msgpack.decode(golden)
    assert all(isinstance(ev, list) and isinstance(ev[0], str) for ev in raw[1])


@pytest.mark.parametrize("prefix", ["v032", "legacy"])
def test_both_encodings_decode_to_the_same_events(prefix: str) -> None:
    basic = decode_batch((GOLDEN / f"{prefix}_basic.msgpack").read_bytes())
    assert basic.ts == 1.5 and basic.data_parallel_rank == 0 and basic.ignored == 0
    assert basic.events == [
        StoredEvent([EngineKey(U), EngineKey(BIG)], None, [1, 2, 3, 4], 2, Medium.GPU, None,
                    [["salt-1"], None], 0, "full_attention"),
        StoredEvent([EngineKey(7)], EngineKey(BIG), [5, 6], 2, Medium.GPU, None, [None], 0,
                    "full_attention"),
        RemovedEvent([EngineKey(U)], Medium.GPU, 0),
        ClearedEvent(),
    ]  # fmt: skip

    raw = decode_batch((GOLDEN / f"{prefix}_bytes_hashes.msgpack").read_bytes())
    stored, removed = raw.events
    assert isinstance(stored, StoredEvent) and isinstance(removed, RemovedEvent)
    # bytes hashes -> their last 8 bytes, big-endian (vLLM's maybe_convert_block_hash).
    assert stored.block_hashes == [
        int.from_bytes(bytes(range(24, 32)), "big"),
        int.from_bytes(bytes(range(56, 64)), "big"),
    ]
    assert stored.parent_block_hash == int.from_bytes(bytes(range(88, 96)), "big")
    assert stored.medium is Medium.CPU  # "cpu" (LMCache style), case-insensitive
    assert removed.block_hashes == stored.block_hashes[:1] and removed.medium is Medium.CPU
    assert raw.data_parallel_rank is None

    lora = decode_batch((GOLDEN / f"{prefix}_lora_offload.msgpack").read_bytes())
    s0, s1, s2, r = lora.events
    assert isinstance(s0, StoredEvent) and isinstance(s1, StoredEvent)
    assert isinstance(s2, StoredEvent) and isinstance(r, RemovedEvent)
    assert s0.lora_name == "adapter" and s0.extra_keys == [["adapter", "tenant-salt"], ["adapter"]]
    assert s1.token_ids == [] and s1.medium is Medium.CPU and s1.block_size == 0
    assert s2.group_idx == 1 and s2.kv_cache_spec_kind == "sliding_window"
    assert r.block_hashes == [11, 12] and r.group_idx == 0
    assert lora.data_parallel_rank == 2


def test_decoded_wire_bytes_round_trip() -> None:
    for batch in cases().values():
        for payload in (encode_batch(batch), encode_batch_legacy(batch)):
            assert len(decode_batch(payload).events) == len(batch.events)
