"""Hostile and malformed request bodies against the real app (uvicorn on loopback), with
the ``kv`` policy rendering locally in front of fake replicas: every input vLLM would
refuse is an OpenAI-shaped 400 from the router, and nothing raises an unhandled
exception (the router's log is checked for ASGI tracebacks)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import router_settings
from tests.router.server import run_server

SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i}." for i in range(40))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def router_errors() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of uvicorn (``Exception in ASGI application``), the router, the
    index and asyncio (an exception in a task nobody awaited), while the block runs."""
    handler = _Records()
    names = ["uvicorn.error", "uvicorn", "router", "index", "asyncio", ""]
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler.records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@pytest.fixture
async def kv_router(tokenizer_dir: Path) -> AsyncIterator[tuple[str, list[FakeReplica]]]:
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
        settings = router_settings(
            fakes, policy="kv", max_body_bytes=1 << 20,
            scoring={"models": [{"name": "m", "block_size": 16,
                                 "tokenizer": str(tokenizer_dir)}],
                     "discover_kv_events": False, "scrape": {"enabled": False}},
        )
        url = await stack.enter_async_context(
            run_server(create_app(settings, registry=CollectorRegistry())))
        yield url, fakes


def _assert_openai_400(status: int, body: bytes, param: str | None = None) -> None:
    assert status == 400, body
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


async def test_out_of_range_token_ids_are_400(
    kv_router: tuple[str, list[FakeReplica]],
) -> None:
    url, fakes = kv_router
    block = list(range(1, 17))
    bad_prompts: list[Any] = [
        [2**32, *block, *block],
        [*block, 2**32 + 5, *block],
        [-1, *block, *block],
        [[*block], [2**40, *block, *block]],
        [[*block, *block, -7]],
        [*block, *block, 2**63 - 1],
    ]
    with router_errors() as errors:
        async with aiohttp.ClientSession() as http:
            for prompt in bad_prompts:
                body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1})
                for path in ("/v1/completions", "/debug/route?endpoint=completions"):
                    async with http.post(url + path, data=body) as resp:
                        _assert_openai_400(resp.status, await resp.read(), "prompt")
                        if path == "/v1/completions":
                            assert "out of vocabulary" in (await resp.json())["error"]["message"]
            # the largest id there is still routes
            ok = orjson.dumps({"model": "m", "prompt": [*block, 2**32 - 1, *block]})
            async with http.post(url + "/v1/completions", data=ok) as resp:
                assert resp.status == 200
    assert not errors, [r.getMessage() for r in errors]
    assert sum(len(f.completions()) for f in fakes) == 1  # no bad request went upstream


async def test_wrong_types_are_400_as_in_vllm_and_string_booleans_coerce(
    kv_router: tuple[str, list[FakeReplica]],
) -> None:
    url, fakes = kv_router
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"stream": "maybe"}, "stream"),
        ({"stream": [True]}, "stream"),
        ({"stream": {"on": 1}}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": "yes"}, "stream_options"),
        ({"user": 12}, "user"),
        ({"n": "two"}, "n"),
        ({"max_tokens": [1]}, "max_tokens"),
        ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
        ({"add_generation_prompt": "sometimes"}, "add_generation_prompt"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": ["just text"]}, "messages"),
    ]
    async with aiohttp.ClientSession() as http:
        for extra, param in cases:
            async with http.post(url + "/v1/chat/completions", json={**base, **extra}) as resp:
                _assert_openai_400(resp.status, await resp.read(), param)
        async with http.post(url + "/v1/completions",
                             json={"model": "m", "prompt": {"text": "x"}}) as resp:
            _assert_openai_400(resp.status, await resp.read(), "prompt")
        # pydantic's lax booleans, as vLLM parses them: "true" streams
        for value in ("true", "1", "yes", 1):
            async with http.post(url + "/v1/chat/completions",
                                 json={**base, "stream": value}) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                text = await resp.text()
            assert text.endswith("data: [DONE]\n\n")
            assert '"usage"' not in text  # the usage chunk the router asked for is removed


async def test_a_string_true_stream_is_relayed_as_it_comes_not_buffered(
    kv_router: tuple[str, list[FakeReplica]],
) -> None:
    """vLLM streams ``"stream": "true"`` (a lax boolean), so the router relays it as a
    stream: the first event reaches the client while the replica is still generating,
    not all of it at the end, read whole as a JSON answer would be."""
    url, fakes = kv_router
    for fake in fakes:
        fake.behaviour.chunk_delay_s = 0.3  # four gaps after the first event: >= 1.2 s
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        for value in ("true", True):
            async with http.post(url + "/v1/chat/completions",
                                 json={**base, "stream": value}) as resp:
                assert resp.status == 200
                assert "content-length" not in resp.headers, (value, resp.headers)
                first = await resp.content.readany()
                t_first = loop.time()
                rest = await resp.read()
                t_end = loop.time()
            assert first.startswith(b"data: ") and (first + rest).endswith(b"data: [DONE]\n\n")
            # buffered, the whole answer arrives at once, at the end
            assert t_end - t_first > 0.6, (value, t_end - t_first, first)


_VALID: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}],
        "max_tokens": 4}),
    ("/v1/completions", {"model": "m", "prompt": SYSTEM + " continue", "max_tokens": 4}),
    ("/v1/completions", {"model": "m", "prompt": list(range(1, 60)), "max_tokens": 4}),
    ("/debug/route", {"model": "m", "messages": [{"role": "user", "content": SYSTEM}]}),
]
_NASTY: list[Any] = [
    None, True, False, 0, -1, 2**32, 2**63 - 1, -(2**63), 1.5, 1e308, "", "x" * 3000,
    "\u0000\u202e\uffff", [], [None], [[]], [[2**40]], [-3], {}, {"a": []},
    [{"role": 1}], [{"role": "user", "content": {"type": "image_url"}}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    {"include_usage": "perhaps"}, [[1, 2], "mixed"], ["a", 3], "true", "false", "auto",
    [2**32, *range(1, 40)], [[2**33, *range(1, 40)]], [-5, *range(1, 40)],
]
_FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "cache_salt", "user",
           "n", "max_tokens", "tools", "tool_choice", "chat_template", "chat_template_kwargs",
           "add_generation_prompt", "continue_final_message", "add_special_tokens",
           "truncate_prompt_tokens", "truncation_side", "documents", "reasoning_effort",
           "echo", "suffix", "prompt_embeds", "lora_request", "priority"]


def _mutants(seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    """``n`` malformed variants of valid bodies: a field replaced by a nasty value, a
    required one deleted, nesting, truncation and byte noise (seeded: deterministic)."""
    rng = random.Random(seed)
    for _ in range(n):
        path, body = rng.choice(_VALID)
        body = orjson.loads(orjson.dumps(body))
        kind = rng.randrange(6)
        if kind <= 2:
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(_FIELDS)] = rng.choice(_NASTY)
        elif kind == 3:
            body.pop(rng.choice(list(body)), None)
        elif kind == 4:
            depth = rng.choice([5, 50, 200])
            nested: Any = "x"
            for _ in range(depth):
                nested = [nested]
            body[rng.choice(_FIELDS)] = nested
        raw = orjson.dumps(body)
        if kind == 5:
            cut = rng.randrange(len(raw))
            raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
        yield path, raw


async def test_fuzzed_bodies_never_crash_the_request_path(
    kv_router: tuple[str, list[FakeReplica]],
) -> None:
    url, _ = kv_router
    statuses: dict[int, int] = {}
    with router_errors() as errors:
        async with aiohttp.ClientSession() as http:
            for path, raw in _mutants(seed=14, n=300):
                async with http.post(url + path, data=raw,
                                     headers={"content-type": "application/json"}) as resp:
                    body = await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert resp.status < 500, (path, raw[:300], body[:300])
                    if resp.status >= 400:  # OpenAI-shaped, the router's and the replica's
                        assert "error" in orjson.loads(body), body
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
    assert not errors, [r.getMessage() for r in errors]
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 20, statuses
