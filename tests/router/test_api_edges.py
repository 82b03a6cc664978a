"""The router's API surface at its edges: unknown models, unknown paths and methods,
client-chosen strings as session keys, and bodies past the limit on ``/debug/route``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from kvkeys.types import ReplicaId
from prompt.registry import ModelSpec, RendererRegistry
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.kv_services import RegistryPrompts
from router.plugins import PolicyContext
from router.policy import Decision, Policy, Receipt, RouteRequest
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat


async def test_unknown_model_is_a_404_naming_the_served_models_without_upstream_work(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    a, b = await fakes(2)
    a.behaviour.models = ["llama", "m"]
    b.behaviour.models = ["qwen"]
    url = await start_router([a, b], policy="kv")
    for i in range(50):
        body = chat(model=f"made-up-{i}")
        for path in ("/v1/chat/completions", "/debug/route"):
            async with client.post(url + path, json=body) as resp:
                assert resp.status == 404
                error = (await resp.json())["error"]
                assert error["code"] == "model_not_found"
                assert f"made-up-{i}" in error["message"]
                assert "Served models: llama, m, qwen." in error["message"]
    long_name = "x" * 100_000
    async with client.post(url + "/v1/chat/completions", json=chat(model=long_name)) as resp:
        assert resp.status == 404 and len(await resp.read()) < 1000  # not echoed whole
    assert not a.completions() and not b.completions()
    assert not [s for s in a.seen + b.seen if s.path == "/tokenize"]


async def test_only_a_model_a_replica_lists_is_learnt(tmp_path: Path) -> None:
    registry = RendererRegistry([])
    listed = {"served-model"}
    prompts = RegistryPrompts(registry, block_size_hint=lambda: 16,
                              served=lambda model: model in listed)
    for i in range(100):
        request = RouteRequest(f"q{i}", "chat", "/v1/chat/completions", f"name-{i}",
                               chat(model=f"name-{i}"), None)
        assert await prompts.prompt(request, None) is None
    assert registry.models() == []  # a client's names created nothing
    request = RouteRequest("q", "chat", "/v1/chat/completions", "served-model",
                           chat(model="served-model"), None)
    await prompts.prompt(request, None)  # no replica to render: no prompt, but learnt
    assert registry.models() == ["served-model"]


async def test_unknown_paths_and_wrong_methods_are_openai_json_from_the_router(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    for method, path, status, allow in [
        ("GET", "/v1/chat/completions", 405, "POST"),
        ("PUT", "/v1/completions", 405, "POST"),
        ("POST", "/v1/models", 405, "GET"),
        ("DELETE", "/health", 405, "GET"),
        ("POST", "/metrics", 405, "GET"),
        ("GET", "/v2/anything", 404, None),
        ("GET", "/", 404, None),
    ]:
        async with client.request(method, url + path) as resp:
            assert resp.status == status, (method, path)
            assert resp.headers["content-type"] == "application/json", (method, path)
            assert "server" not in resp.headers
            if allow is not None:
                assert allow in resp.headers["allow"]
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == ("method_not_allowed" if status == 405 else "not_found")
    assert not fake.completions()


class _Keys:
    name = "keys"

    def __init__(self) -> None:
        self.keys: list[str | None] = []

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        self.keys.append(request.session_key)
        return Decision(tuple(candidates), self.name, "test")

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        pass


async def test_client_chosen_session_strings_are_kept_at_fixed_size(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (fake,) = await fakes(1)
    policy = _Keys()

    def factory(ctx: PolicyContext) -> Policy:
        return policy

    url = await start_router([fake], policy="keys", policy_factories={"keys": factory})
    async with client.post(url + "/v1/chat/completions", json=chat(user="u" * (512 << 10))):
        pass
    async with client.post(url + "/v1/chat/completions", json=chat(),
                           headers={"X-Session-ID": "s" * 4000}):
        pass
    async with client.post(url + "/v1/chat/completions", json=chat(user="short")):
        pass
    assert [len(k or "") for k in policy.keys] == [32, 32, 32]
    assert len(set(policy.keys)) == 3
    # the replica still sees what the client sent
    assert fake.completions()[1].headers["x-session-id"] == "s" * 4000


@pytest.mark.parametrize("declared", [False, True])
async def test_debug_route_refuses_a_big_body_while_reading_it(
    fakes: StartFakes, start_router: StartRouter, declared: bool
) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], policy="kv", max_body_bytes=1 << 20)
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    total = 160 << 20
    framing = (b"Content-Length: %d\r\n" % total if declared
               else b"Transfer-Encoding: chunked\r\n")
    writer.write(b"POST /debug/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + framing + b"\r\n")
    answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    chunk = b"[" * (64 << 10)
    sent = 0
    try:
        while sent < total and not answer.done():
            writer.write(chunk if declared else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            await asyncio.wait_for(writer.drain(), 5)
    except (ConnectionError, TimeoutError):
        pass  # the router stopped reading: what matters is what it answered
    head = await asyncio.wait_for(answer, 10)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert sent < 32 << 20  # refused long before the 160 MiB were sent
    writer.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


async def test_spec_registry_is_untouched_by_unknown_models(tokenizer_dir: Path) -> None:
    registry = RendererRegistry([ModelSpec(name="m", block_size=16,
                                           tokenizer=str(tokenizer_dir))])
    prompts = RegistryPrompts(registry, block_size_hint=lambda: 16, served=lambda m: m == "m")
    request = RouteRequest("q", "chat", "/v1/chat/completions", "other", chat(model="other"),
                           None)
    assert await prompts.prompt(request, "http://127.0.0.1:9") is None
    assert registry.models() == ["m"]
