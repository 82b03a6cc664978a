"""Real vLLM publishes the KV events and usage kvroute relies on, in the documented shape.

A two-turn chat through a real replica: turn 1 produces ``BlockStored`` events on a real
ZMQ SUB with vLLM's framing (topic, 8-byte big-endian sequence number, msgpack batch
``[ts, events, dp_rank]``), decodable by ``index.events.decode_batch``, carrying the
full blocks of the prompt; turn 2 reports ``prompt_tokens_details.cached_tokens``
covering turn 1's full blocks; replay answers with the same batches; and
``/reset_prefix_cache`` publishes ``AllBlocksCleared``.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
from vllm_fleet import EventTap, VllmReplica

from index.events import ClearedEvent, StoredEvent
from kvkeys.types import Medium

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are a careful assistant for a logistics company. Answer briefly, cite the "
    "relevant policy number, and never invent shipment identifiers. "
) * 3


def _chat(replica: VllmReplica, messages: list[dict[str, str]]) -> dict[str, object]:
    r = httpx.post(
        replica.url + "/v1/chat/completions",
        json={
            "model": replica.served_model_name,
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0.0,
        },
        timeout=120.0,
    )
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def _tokenize(replica: VllmReplica, messages: list[dict[str, str]]) -> list[int]:
    r = httpx.post(
        replica.url + "/tokenize",
        json={"model": replica.served_model_name, "messages": messages},
        timeout=60.0,
    )
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def test_chat_publishes_block_stored_and_turn_two_hits(vllm_replica: VllmReplica) -> None:
    replica = vllm_replica
    bs = replica.block_size
    replica.reset_prefix_cache()
    with EventTap(replica.events_endpoint, replica.replay_endpoint) as tap:
        mark = tap.mark()
        turn1 = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is shipment 7 and when does it arrive?"},
        ]
        body1 = _chat(replica, turn1)
        tap.settle()
        usage1 = body1["usage"]
        assert isinstance(usage1, dict)
        prompt1 = usage1["prompt_tokens"]
        assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
        batches = tap.since(mark)
        assert batches, "no KV event batch after a chat"
        assert not tap.frame_errors
        assert all(b.topic == replica.topic.encode() for b in batches)
        seqs = [b.seq for b in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs

        # The documented payload: a positional array [ts, events, dp_rank] with events as
        # tagged maps (vLLM >= 0.24), decoded untyped here and typed by index.events.
        raw = msgspec.msgpack.decode(batches[0].payload)
        assert isinstance(raw, list) and len(raw) == 3
        assert isinstance(raw[0], float) and raw[2] == 0
        # The reset above is published lazily: vLLM takes the block pool's queued events
        # only after an engine step, so AllBlocksCleared rides in the first batch of the
        # next request, ahead of its BlockStored.
        kinds = [e["type"] for e in raw[1]]
        assert kinds[0] in ("AllBlocksCleared", "BlockStored"), kinds
        first = next(e for e in raw[1] if e["type"] == "BlockStored")
        assert first["block_size"] == bs and first["medium"] == "GPU"
        assert first["kv_cache_spec_kind"] == "full_attention" and first["group_idx"] == 0

        stored = [e for b in batches for e in b.batch.events if isinstance(e, StoredEvent)]
        tokens = [t for e in stored for t in e.token_ids]
        prompt_ids = _tokenize(replica, turn1)
        assert len(prompt_ids) == prompt1
        # Full blocks of the prompt, in order, from block 0 (max_tokens=4 cannot fill a
        # block of 32 past the prompt's full blocks... unless the tail was nearly full).
        assert tokens[: prompt1 // bs * bs] == prompt_ids[: prompt1 // bs * bs]
        assert stored[0].parent_block_hash is None
        assert all(e.medium is Medium.GPU and e.block_size == bs for e in stored)
        assert all(len(e.token_ids) == bs * len(e.block_hashes) for e in stored)
        for prev, nxt in zip(stored, stored[1:], strict=False):
            assert nxt.parent_block_hash == prev.block_hashes[-1]

        # Replay returns the same bytes under the same sequence numbers.
        replayed = {b.seq: b.payload for b in tap._replay_after(mark)}
        assert {b.seq: b.payload for b in batches}.items() <= replayed.items()

        assistant = body1["choices"][0]["message"]["content"]  # type: ignore[index]
        turn2 = [
            *turn1,
            {"role": "assistant", "content": str(assistant)},
            {"role": "user", "content": "And shipment 8?"},
        ]
        body2 = _chat(replica, turn2)
        usage2 = body2["usage"]
        assert isinstance(usage2, dict)
        # Turn 1's prompt is a prefix of turn 2's, so all its full blocks hit.
        assert usage2["prompt_tokens_details"]["cached_tokens"] == prompt1 // bs * bs

        tap.settle()  # turn 2's own events must not count as the reset's
        mark = tap.mark()
        replica.reset_prefix_cache()
        tap.settle()
        # Nothing yet: the clear waits for the next engine step (see above).
        assert [e for b in tap.since(mark) for e in b.batch.events] == []
        body3 = _chat(replica, turn1)
        tap.settle()
        after = [e for b in tap.since(mark) for e in b.batch.events]
        assert isinstance(after[0], ClearedEvent), after
        restored = [e for e in after[1:] if isinstance(e, StoredEvent)]
        assert len(restored) == len(after) - 1
        # The cache is empty again: turn 1 misses and is stored from block 0 again.
        assert body3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]
        assert [t for e in restored for t in e.token_ids] == tokens
