"""Remote rendering against a fake replica: a real aiohttp server on loopback.

The fake replica answers ``/tokenize`` with transformers (an implementation independent
of ours), and ``/v1/chat/completions/render`` / ``/v1/completions/render`` likewise; it
records every payload, and can be told to be slow or broken.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvkeys.keys import block_keys
from prompt.errors import RemoteRenderFailed, RemoteRenderTimeout, RenderUnsupported
from prompt.keyer import KeyContext
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer, tokenize_chat_payload


@dataclass
class FakeReplica:
    hf: Any
    url: str = ""
    payloads: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    delay_s: float = 0.0
    status: int = 200
    drift: bool = False

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = []
        for m in body["messages"]:
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            messages.append({"role": m["role"], "content": parts or []})
        kwargs = dict(body.get("chat_template_kwargs") or {})
        ids: list[int] = self.hf.apply_chat_template(
            messages,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        return [*ids[:-1], ids[-1] + 1] if self.drift else ids

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.payloads.append((request.path, body))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=self.status)
        if request.path == "/tokenize":
            if "messages" in body:
                ids = self.chat_ids(body)
            else:
                ids = self.hf(body["prompt"], add_special_tokens=body["add_special_tokens"])[
                    "input_ids"
                ]
            return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})
        if request.path == "/v1/chat/completions/render":
            return web.json_response({"request_id": "r", "token_ids": self.chat_ids(body)})
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        return web.json_response(
            [{"request_id": "r", "token_ids": self.hf(p)["input_ids"]} for p in prompts]
        )


@pytest.fixture
async def replica(hf_tokenizer: Callable[[str], Any]) -> AsyncIterator[FakeReplica]:
    fake = FakeReplica(hf=hf_tokenizer("chatml"))
    app = web.Application()
    for path in ("/tokenize", "/v1/chat/completions/render", "/v1/completions/render"):
        app.router.add_post(path, fake.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    try:
        yield fake
    finally:
        await server.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


CTX = KeyContext(model="remote-model", block_size=4, cache_salt="s")
BODY: dict[str, Any] = {
    "model": "remote-model",
    "messages": [{"role": "user", "content": "hello from far away"}],
    "cache_salt": "s",
}


async def test_tokenize_fallback_builds_keys_and_caches(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    remote = RemoteRenderer(session, timeout_s=5)
    prompt = await remote.render_chat(replica.url, BODY, CTX)
    expected = replica.chat_ids(BODY)
    assert prompt.token_ids == expected and prompt.source == "remote"
    assert prompt.block_keys == block_keys(expected, 4, model="remote-model", cache_salt="s")
    again = await remote.render_chat(replica.url, BODY, CTX)
    assert again.token_ids == expected
    assert len(replica.payloads) == 1
    assert (remote.stats.fallbacks, remote.stats.cache_hits, remote.stats.requests) == (2, 1, 1)


def test_tokenize_payload_folds_chat_only_fields_into_kwargs() -> None:
    body = {
        "model": "m",
        "messages": [],
        "documents": [{"text": "d"}],
        "reasoning_effort": "none",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"x": 1},
        "temperature": 0.3,
        "stream": True,
    }
    payload = tokenize_chat_payload(body)
    assert payload == {
        "model": "m",
        "messages": [],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "tools": body["tools"],
        "chat_template_kwargs": {
            "x": 1,
            "documents": [{"text": "d"}],
            "reasoning_effort": "none",
            "enable_thinking": False,
        },
    }
    assert "tools" not in tokenize_chat_payload(body, exclude_tools_when_tool_choice_none=True)
    user_thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert tokenize_chat_payload(user_thinking)["chat_template_kwargs"]["enable_thinking"] is True


async def test_render_endpoint_when_enabled(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    remote = RemoteRenderer(session, timeout_s=5, use_render_endpoint=True)
    prompt = await remote.render_chat(replica.url, BODY, CTX)
    assert replica.payloads[0] == ("/v1/chat/completions/render", BODY)
    assert prompt.token_ids == replica.chat_ids(BODY)
    prompts = await remote.render_completion(
        replica.url, {"model": "m", "prompt": ["a b", "c"]}, CTX
    )
    assert [p.token_ids for p in prompts] == [
        replica.hf("a b")["input_ids"],
        replica.hf("c")["input_ids"],
    ]


async def test_completion_fallback_per_prompt(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    remote = RemoteRenderer(session, timeout_s=5)
    body = {"model": "m", "prompt": ["one two", "three"], "add_special_tokens": False}
    prompts = await remote.render_completion(replica.url, body, CTX)
    assert [p.token_ids for p in prompts] == [
        replica.hf("one two", add_special_tokens=False)["input_ids"],
        replica.hf("three", add_special_tokens=False)["input_ids"],
    ]
    assert [p for p, _ in replica.payloads] == ["/tokenize", "/tokenize"]
    ids_only = await remote.render_completion(replica.url, {"model": "m", "prompt": [1, 2, 3]}, CTX)
    assert ids_only[0].token_ids == [1, 2, 3] and len(replica.payloads) == 2
    cut = await remote.render_completion(
        replica.url, {"model": "m", "prompt": [[1, 2, 3]], "truncate_prompt_tokens": 2}, CTX
    )
    assert cut[0].token_ids == [2, 3]


async def test_timeout_and_errors_are_typed_and_counted(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    remote = RemoteRenderer(session, timeout_s=0.2)
    replica.delay_s = 1.0
    with pytest.raises(RemoteRenderTimeout):
        await remote.render_chat(replica.url, BODY, CTX)
    assert remote.stats.timeouts == 1
    replica.delay_s = 0.0
    replica.status = 500
    with pytest.raises(RemoteRenderFailed) as info:
        await remote.render_chat(replica.url, BODY, CTX)
    assert not isinstance(info.value, RemoteRenderTimeout)
    with pytest.raises(RemoteRenderFailed):
        await remote.render_chat("http://127.0.0.1:1", BODY, CTX)
    assert remote.stats.errors == 2


async def test_registry_falls_back_for_models_without_a_tokenizer(
    replica: FakeReplica, session: aiohttp.ClientSession, tiny_dirs: dict[str, Path]
) -> None:
    remote = RemoteRenderer(session, timeout_s=5)
    registry = RendererRegistry(
        [
            ModelSpec(name="remote-model", block_size=4, loras=("ad",)),
            ModelSpec(name="local", block_size=4, tokenizer=tiny_dirs["chatml"]),
        ],
        remote=remote,
    )
    prompt = await registry.chat({**BODY, "model": "ad"}, replica_url=replica.url)
    assert prompt.lora_name == "ad" and prompt.model == "remote-model"
    assert prompt.block_keys == block_keys(
        prompt.token_ids, 4, model="remote-model", cache_salt="s", lora_name="ad"
    )
    with pytest.raises(RenderUnsupported):
        registry.render_chat(BODY)
    with pytest.raises(RenderUnsupported):
        await registry.chat(BODY)  # no replica to ask
    local = await registry.chat({**BODY, "model": "local"}, replica_url=replica.url)
    assert local.source == "local"
    # Media cannot be rendered locally: the replica is asked even for a local model.
    image = {
        "model": "local",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}],
            }
        ],
    }
    replica.payloads.clear()
    replica.status = 400
    with pytest.raises(RemoteRenderFailed):
        await registry.chat(image, replica_url=replica.url)
    assert replica.payloads and replica.payloads[0][0] == "/tokenize"
    replica.status = 200
    completions = await registry.completion(
        {"model": "remote-model", "prompt": "far"}, replica_url=replica.url
    )
    assert completions[0].token_ids == replica.hf("far")["input_ids"]
    assert registry.stats.remote_chat == 1 and registry.stats.remote_completion == 1
    assert registry.stats.local_chat == 1
    assert json.dumps(replica.payloads[-1][1])  # JSON bodies only
