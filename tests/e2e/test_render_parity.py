"""Issue 3 acceptance: kvroute renders, tokenises and keys prompts exactly as real vLLM.

For multi-turn chat conversations, with and without ``cache_salt``, against the real
vLLM CPU engine on the tiny Llama-3-style model:

1. the token ids kvroute renders locally (``index.RendererRegistry`` on the same
   tokenizer directory) equal vLLM's ``POST /tokenize`` for the same messages;
2. they equal the token ids vLLM reports in its ``BlockStored`` events: the events of
   turns 1..t, concatenated in order, are exactly the full blocks of turn t's prompt
   (each turn stores only the blocks the cache did not already hold);
3. the keys kvroute computes from the prompt (``Prompt.block_keys``) equal the keys it
   computes from those events, both through the router's ingest path
   (``index.event_applier.EventIngestor`` into an ``InMemoryIndex``: parent chain through
   ``parent_block_hash``, salt from ``extra_keys``) and directly with
   ``kvkeys.keys.block_keys``;
4. vLLM's ``cached_tokens`` on every turn equals what kvroute predicts from its index
   (leading blocks held, the last prompt token never served from cache);
5. a salted conversation shares no engine hash and no kvroute key with the unsalted
   one, and gets no cache hit from it.

Every request uses ``max_tokens=1``: the single generated token is never computed into
the KV cache, so every stored block is a prompt block.  The conversation history is
scripted (the assistant turns are fixed text), so later turns are append-only
extensions of earlier ones, as a client's are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from vllm_fleet import EventTap, VllmReplica

from index.event_applier import EventIngestor
from index.events import StoredEvent
from index.memory import InMemoryIndex
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, ReplicaId, RequestKey
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are the support assistant of Example Freight Ltd.\n"
    "Rules:\n"
    "1. Quote the policy number (e.g. P-104) for every claim.\n"
    "2. Never invent tracking ids; ask for them instead.\n"
    "3. Keep answers under 120 words, and use metric units (kg, km).\n"
    "Café hours: Mon–Fri 08:00–18:00 — closed on public holidays. "
) * 2

# (user, assistant) exchanges; the last user turn has no reply yet.
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "support": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "My parcel 4471-AZ hasn't moved since Tuesday. Why?"},
        {"role": "assistant", "content": "Sorry about that! Per P-104, parcels idle for "
                                         "more than 48 h are re-scanned at the depot."},
        {"role": "user", "content": "It weighs 12.5 kg and goes to Zürich, 310 km away.\n\n"
                                    "Does that change anything?"},
        {"role": "assistant", "content": "Cross-border parcels over 10 kg need form "
                                         "C-22 (P-131). I can send it to you."},
        {"role": "user", "content": "Yes please — and what's the fee?  Tabs\tand  spaces."},
        {"role": "assistant", "content": "The fee is 14.90 CHF. Form sent to your e-mail."},
        {"role": "user", "content": "Thanks! 🙂 Last question: can I change the address?"},
    ],
    "parts": [
        {"role": "user", "content": [
            {"type": "text", "text": "Summarise this log excerpt:\n"},
            {"type": "text", "text": "2026-11-29T10:00:01Z WARN disk 91% full on /var\n" * 6},
        ]},
        {"role": "assistant", "content": "The /var volume stayed above 90% for six checks."},
        {"role": "user", "content": [{"type": "text", "text": "Which command frees space "
                                                              "safely? Answer in one line."}]},
        {"role": "assistant", "content": "`journalctl --vacuum-size=200M`"},
        {"role": "user", "content": "def f(x):\n    return {'a': x ** 2}  # why not a list?"},
    ],
}


def _user_turn_ends(messages: list[dict[str, Any]]) -> list[int]:
    """Prefix lengths that end on a user message: the successive requests of a chat."""
    return [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]


def _body(
    replica: VllmReplica, messages: list[dict[str, Any]], salt: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": replica.served_model_name,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0.0,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at token {i}: {x} != {y}"
    return f"lengths {len(a)} != {len(b)}"


class _Conversation:
    """Runs one conversation against a replica and checks every turn."""

    def __init__(
        self, replica: VllmReplica, registry: RendererRegistry, tap: EventTap, salt: str | None
    ) -> None:
        self.replica = replica
        self.registry = registry
        self.tap = tap
        self.salt = salt
        self.index = InMemoryIndex()
        self.rid = ReplicaId(replica.id)
        self.ingestor = EventIngestor(self.index, self.rid, replica.served_model_name)
        self.event_tokens: list[int] = []
        self.event_hashes: list[EngineKey] = []
        self.event_salts: list[str | None] = []
        self.prompts: list[Prompt] = []
        self.cached: list[int] = []

    def run(self, client: httpx.Client, messages: list[dict[str, Any]]) -> None:
        bs = self.replica.block_size
        for end in _user_turn_ends(messages):
            body = _body(self.replica, messages[:end], self.salt)
            prompt = self.registry.render_chat(body)
            self.prompts.append(prompt)

            # (1) Local rendering equals vLLM's /tokenize.
            tok = _post(client, "/tokenize", {"model": body["model"], "messages": body["messages"]})
            assert prompt.token_ids == tok["tokens"], _first_difference(
                prompt.token_ids, tok["tokens"]
            )

            # (4) The prediction from the index built from events so far.
            held = self.index.lookup_sync(prompt.block_keys).blocks(self.rid)
            predicted = prompt.expected_cached_tokens(held)

            mark = self.tap.mark()
            out = _post(client, "/v1/chat/completions", body)
            self.tap.settle()
            usage = out["usage"]
            self.cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            assert usage["prompt_tokens"] == prompt.num_tokens
            assert usage["prompt_tokens_details"]["cached_tokens"] == predicted, (
                f"turn ending at message {end}: vLLM cached "
                f"{usage['prompt_tokens_details']['cached_tokens']}, kvroute predicted "
                f"{predicted} ({held} blocks held)"
            )

            for tapped in self.tap.since(mark):
                asyncio.run(self.ingestor.apply(tapped.batch))
                for ev in tapped.batch.events:
                    if isinstance(ev, StoredEvent):
                        assert ev.block_size == bs
                        if ev.parent_block_hash is None:
                            self.event_tokens.clear()
                            self.event_hashes.clear()
                            self.event_salts.clear()
                        else:
                            assert self.event_hashes and ev.parent_block_hash == (
                                self.event_hashes[-1]
                            ), "events do not continue the conversation's chain"
                        self.event_tokens.extend(ev.token_ids)
                        self.event_hashes.extend(ev.block_hashes)
                        extra = ev.extra_keys or [None] * len(ev.block_hashes)
                        self.event_salts.extend(
                            None if e is None else str(list(e)[0]) for e in extra
                        )

            # (2) Events, concatenated over the turns, are the prompt's full blocks.
            full = prompt.num_tokens // bs * bs
            assert self.event_tokens == prompt.token_ids[:full], _first_difference(
                self.event_tokens, prompt.token_ids[:full]
            )
            # The salt is published on block 0 only.
            assert self.event_salts[:1] == [self.salt]
            assert all(s is None for s in self.event_salts[1:])

            # (3) Keys from the prompt == keys from the events (ingest path and direct).
            via_ingest = [
                self.index.request_key_sync(self.rid, h) for h in self.event_hashes
            ]
            assert via_ingest == prompt.block_keys
            direct = block_keys(
                self.event_tokens, bs, model=self.replica.served_model_name,
                cache_salt=self.event_salts[0] if self.event_salts else None,
            )
            assert direct == prompt.block_keys

    @property
    def keys(self) -> set[RequestKey]:
        return {k for p in self.prompts for k in p.block_keys}


@pytest.fixture(scope="module")
def registry(vllm_replica: VllmReplica) -> RendererRegistry:
    return RendererRegistry(
        [
            ModelSpec(
                name=vllm_replica.served_model_name,
                block_size=vllm_replica.block_size,
                tokenizer=vllm_replica.model_dir,
                max_model_len=vllm_replica.spec.max_model_len,
            )
        ]
    )


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompt_tokens_and_keys_match_vllm_events(
    vllm_replica: VllmReplica, registry: RendererRegistry, name: str
) -> None:
    messages = CONVERSATIONS[name]
    replica = vllm_replica
    replica.reset_prefix_cache()
    with EventTap(replica.events_endpoint, replica.replay_endpoint) as tap, httpx.Client(
        base_url=replica.url, timeout=120.0
    ) as client:
        plain = _Conversation(replica, registry, tap, salt=None)
        plain.run(client, messages)
        assert len(plain.prompts) >= 3
        assert plain.prompts[-1].num_tokens >= 4 * replica.block_size
        assert plain.cached[0] == 0 and all(c > 0 for c in plain.cached[1:]), plain.cached

        # Same conversation, salted: same tokens, no shared hash or key, no hit.
        salted = _Conversation(replica, registry, tap, salt="tenant-a")
        salted.run(client, messages)
        assert salted.cached[0] == 0 and salted.cached[1:] == plain.cached[1:]
        assert [p.token_ids for p in salted.prompts] == [p.token_ids for p in plain.prompts]
        assert not set(salted.event_hashes) & set(plain.event_hashes)
        assert not salted.keys & plain.keys

        # A second salt is isolated from the first.
        other = _Conversation(replica, registry, tap, salt="tenant-b")
        other.run(client, messages[: _user_turn_ends(messages)[0]])
        assert not other.keys & salted.keys
