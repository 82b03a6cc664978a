"""No prompt text, API key or session id in the router's logs at the default level (info),
nor in ``/metrics``: requests that carry distinctive ones go through the kv policy on
simulated replicas (successes, streams, a prefix break, refusals, bad bodies, the debug
route) while every log record of the process is captured."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from replica.sim.server import start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.app import create_app
from router.config import RouterSettings
from tests.router.server import run_server

MODEL = "sim-llama"
PROMPT = "zebra-quokka-prompt-5521"
SESSION = "session-okapi-8812"
USER = "user-lemur-1234"
KEY = "sk-pangolin-key-3390"
WRONG_KEY = "sk-wrong-axolotl-4410"
UPSTREAM_KEY = "upstream-narwhal-7781"
SECRETS = (PROMPT, SESSION, USER, KEY, WRONG_KEY, UPSTREAM_KEY,
           hashlib.sha256(KEY.encode()).hexdigest())


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record at info and above, the uvicorn loggers (which do not propagate)
    included."""
    caplog.set_level(logging.INFO)
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        uvicorn_logger.removeHandler(caplog.handler)


def _chat(system: str, *turns: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": MODEL, "max_tokens": 8, "messages": messages, **extra}


async def test_no_prompt_key_or_session_in_logs(
        tmp_path: Path, logs: pytest.LogCaptureFixture) -> None:
    tok = build_tokenizer(tmp_path, template="llama3")
    async with AsyncExitStack() as stack:
        sim = await stack.enter_async_context(
            start_sim(tok, model=MODEL, num_blocks=1024, time_scale=0.002, seed=0))
        settings = RouterSettings.model_validate({
            "replicas": [{"url": sim.url, "id": "r0", "models": [MODEL],
                          "kv_events_endpoint": sim.kv_events_endpoint,
                          "replay_endpoint": sim.replay_endpoint}],
            "policy": "kv",
            "scoring": {"models": [{"name": MODEL, "block_size": 16, "tokenizer": str(tok)}],
                        "discover_kv_events": False},
            "auth": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                               "tenant": "t"}],
                     "tenants": [{"name": "t", "trusted": True}],
                     "upstream_key": UPSTREAM_KEY},
        })
        assert settings.log_level == "info"
        url = await stack.enter_async_context(
            run_server(create_app(settings, registry=CollectorRegistry())))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        ok = {"Authorization": f"Bearer {KEY}", "X-Session-ID": SESSION}
        system = f"You answer questions about {PROMPT}. " * 20
        calls: list[tuple[str, dict[str, Any] | bytes, dict[str, str], int]] = [
            ("/v1/chat/completions", _chat(system, f"tell me {PROMPT}"), ok, 200),
            ("/v1/chat/completions", _chat(system, f"tell me {PROMPT}", "sure",
                                           f"more {PROMPT}", stream=True), ok, 200),
            # The session's earlier turn rewritten: a prefix break, logged at info.
            ("/v1/chat/completions", _chat(f"Rewritten {PROMPT}. " * 20, f"tell me {PROMPT}",
                                           "sure", f"again {PROMPT}"), ok, 200),
            ("/v1/chat/completions", _chat(system, PROMPT, user=USER),
             {"Authorization": f"Bearer {KEY}"}, 200),
            ("/v1/chat/completions", _chat(system, PROMPT),
             {"Authorization": f"Bearer {WRONG_KEY}", "X-Session-ID": SESSION}, 401),
            ("/v1/chat/completions", b'{"model": "sim-llama", "messages": [{"content": "'
             + PROMPT.encode(), ok, 400),
            ("/v1/completions", {"model": MODEL, "prompt": f"complete {PROMPT}",
                                 "user": USER}, ok, 200),
            ("/debug/route", _chat(system, PROMPT), ok, 200),
            ("/debug/route", _chat(system, PROMPT),
             {"Authorization": f"Bearer {WRONG_KEY}"}, 401),
        ]
        for path, body, headers, status in calls:
            kwargs: dict[str, Any] = ({"data": body, "headers": {
                **headers, "Content-Type": "application/json"}}
                if isinstance(body, bytes) else {"json": body, "headers": headers})
            async with http.post(url + path, **kwargs) as resp:
                await resp.read()
                assert resp.status == status, (path, await resp.text())
        async with http.get(url + "/metrics") as resp:
            exposition = await resp.text()

    records = logs.records
    logged = "\n".join(
        f"{r.name} {r.levelname} {r.getMessage()} {r.exc_text or ''}" for r in records)
    assert any(r.name.startswith("router") and "prefix break" in r.getMessage()
               for r in records), logged  # the capture works and the router logged
    for secret in SECRETS:
        assert secret not in logged, secret
        assert secret not in exposition, secret
