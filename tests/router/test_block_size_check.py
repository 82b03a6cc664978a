"""A configured block size that differs from the replicas' is caught from their first KV
events: an error naming the model, both sizes and the fix, a metric, and no predictions
made with the wrong size."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from index.event_applier import BatchResult
from kvkeys.types import ReplicaId
from router.block_size_check import BlockSizeCheck
from tests.router.test_kv_integration import (  # noqa: F401 - fixtures
    MODEL,
    Conversation,
    _fleet,
    send,
    stack,
    tokenizer_dir,
)

A, B = ReplicaId("a"), ReplicaId("b")


def test_the_first_mismatching_batch_turns_the_model_off_until_sizes_agree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    counter = Counter("mismatch_total", "test", ["model"], registry=registry)
    models = {A: "m", B: "m"}
    check = BlockSizeCheck({"m": 16, "other": 32}, model_of=models.get,
                           base_of=lambda name: "m" if name in ("m", "m-lora") else name,
                           mismatches=counter)  # fmt: skip
    check.batch_applied(A, BatchResult(block_size=16))
    check.batch_applied(A, BatchResult())  # no store: nothing learnt
    assert not check.disabled("m") and not caplog.records
    with caplog.at_level(logging.ERROR, logger="router.block_size_check"):
        check.batch_applied(B, BatchResult(block_size=32))
        check.batch_applied(B, BatchResult(block_size=32))
    assert check.disabled("m") and check.disabled("m-lora") and not check.disabled("other")
    (record,) = caplog.records  # logged once, counted every time
    msg = record.getMessage()
    for part in ("'m'", "block_size 16", "replica b", "32 tokens", "block_size to 32",
                 "--block-size 16"):  # fmt: skip
        assert part in msg, msg
    assert registry.get_sample_value("mismatch_total", {"model": "m"}) == 2.0
    # The replica comes back with the configured size: predictions resume.
    check.batch_applied(B, BatchResult(block_size=16))
    assert not check.disabled("m")
    # A model that is not configured (learnt at run time) is not checked.
    models[A] = "auto"
    check.batch_applied(A, BatchResult(block_size=64))
    assert not check.disabled("auto")


async def test_a_router_configured_with_another_block_size_stops_predicting(
    stack: AsyncExitStack,  # noqa: F811
    tokenizer_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The simulated replicas use blocks of 16 tokens; the router is told 32.
    model = {"name": MODEL, "block_size": 32, "tokenizer": str(tokenizer_dir)}
    f = await _fleet(stack, tokenizer_dir, models=[model])
    conv = Conversation(system="You explain block sizes. " * 40, session="s1")
    with caplog.at_level(logging.ERROR, logger="router.block_size_check"):
        await send(f, conv, "first question, long enough to fill blocks " * 4, stream=False)
        for _ in range(200):
            if f.metric("router_kv_block_size_mismatch_total", model=MODEL) >= 1:
                break
            await asyncio.sleep(0.05)
    assert f.metric("router_kv_block_size_mismatch_total", model=MODEL) >= 1
    assert any(MODEL in r.getMessage() and "block_size 32" in r.getMessage()
               and "16 tokens" in r.getMessage() for r in caplog.records)  # fmt: skip
    turn = await send(f, conv, "and a follow-up question", stream=False)
    # Without the check this turn would be routed on keys of 32-token blocks that no
    # event key can ever equal; now the model has no prediction at all.
    assert turn.reason == "affinity_no_prompt"
    assert turn.predicted in (None, 0)
