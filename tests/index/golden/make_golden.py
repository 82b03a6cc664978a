# mypy: ignore-errors
"""Regenerate the golden KV event payloads with the real vLLM classes.

Run with the vLLM virtualenv (vLLM 0.32.0 CPU build)::

    /work/main/.venv-vllm/bin/python tests/index/golden/make_golden.py

It writes ``*.msgpack`` next to this file.  ``test_events_golden.py`` decodes them and
checks that ``index.events`` re-encodes the same values to the same bytes; the tests do
not need vLLM.  The ``legacy_*`` files are the tagged-array encoding of vLLM <= 0.23:
vLLM 0.32 no longer has it, so they are built here from the real 0.32 event objects as
``[tag, *fields of the 0.22/0.23 layout]`` and encoded with msgspec, which is how the
array-like ``KVCacheEvent`` of 0.22/0.23 serialised them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

HERE = Path(__file__).parent
U = 0x1122334455667788
BIG = 0xF0E1D2C3B4A59687  # >= 2**63: msgpack uint64 (0xcf)
LEGACY_STORED = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)  # fmt: skip
LEGACY_REMOVED = ("block_hashes", "medium", "group_idx")


def cases() -> dict[str, KVEventBatch]:
    return {
        "v032_basic": KVEventBatch(
            ts=1.5,
            events=[
                BlockStored(
                    block_hashes=[U, BIG],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4],
                    block_size=2,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[("salt-1",), None],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                BlockStored(
                    block_hashes=[7],
                    parent_block_hash=BIG,
                    token_ids=[5, 6],
                    block_size=2,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                BlockRemoved(block_hashes=[U], medium="GPU", group_idx=0),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        ),
        "v032_bytes_hashes": KVEventBatch(
            ts=1700000000.25,
            events=[
                BlockStored(
                    block_hashes=[bytes(range(32)), bytes(range(32, 64))],
                    parent_block_hash=bytes(range(64, 96)),
                    token_ids=[9] * 8,
                    block_size=4,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                ),
                BlockRemoved(block_hashes=[bytes(range(32))], medium="CPU"),
            ],
            data_parallel_rank=None,
        ),
        "v032_lora_offload": KVEventBatch(
            ts=2.0,
            events=[
                BlockStored(
                    block_hashes=[11, 12],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4],
                    block_size=2,
                    lora_id=3,
                    medium="GPU",
                    lora_name="adapter",
                    extra_keys=[("adapter", "tenant-salt"), ("adapter",)],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                    locality="LOCAL",
                    session_id="s1",
                ),
                BlockStored(
                    block_hashes=[12],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=0,
                    locality="LOCAL",
                    ownership="tier-1",
                ),
                BlockStored(
                    block_hashes=[21],
                    parent_block_hash=None,
                    token_ids=[1, 2],
                    block_size=2,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128,
                ),
                BlockRemoved(block_hashes=[11, 12], medium="GPU", group_idx=0, locality="LOCAL"),
            ],
            data_parallel_rank=2,
        ),
    }


def legacy(batch: KVEventBatch) -> bytes:
    events: list[list[object]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append(["BlockStored", *(getattr(ev, f) for f in LEGACY_STORED)])
        elif isinstance(ev, BlockRemoved):
            events.append(["BlockRemoved", *(getattr(ev, f) for f in LEGACY_REMOVED)])
        else:
            events.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])


def main() -> None:
    enc = msgspec.msgpack.Encoder()
    for name, batch in cases().items():
        (HERE / f"{name}.msgpack").write_bytes(enc.encode(batch))
        (HERE / f"legacy_{name[5:]}.msgpack").write_bytes(legacy(batch))
        print("wrote", name)


if __name__ == "__main__":
    main()
