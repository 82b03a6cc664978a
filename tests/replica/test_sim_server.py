"""The simulated replica over real loopback HTTP and real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import zmq
import zmq.asyncio

from index.events import ClearedEvent, StoredEvent, decode_batch
from kvkeys.keys import block_keys
from replica.sim.engine import EngineConfig
from replica.sim.scheduler import SimRequest, StepPlan
from replica.sim.server import SimHandle, start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer

MODEL = "sim-llama"
TIMEOUT = aiohttp.ClientTimeout(total=10)
LONG_TEXT = " ".join(f"word{i} is here" for i in range(60))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


@pytest.fixture
async def sim(tokenizer_dir: Path) -> AsyncIterator[SimHandle]:
    async with start_sim(tokenizer_dir, model=MODEL, num_blocks=256, time_scale=0.01,
                         topic="kv@sim@m") as handle:
        yield handle


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield session


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, **extra}


async def _sse(resp: aiohttp.ClientResponse) -> list[str]:
    data = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            data.append(line[6:])
        else:
            assert line == "", line
    return data


async def test_streaming_chat_has_vllm_chunk_shapes(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    body = _chat("hello", stream=True, stream_options={"include_usage": True})
    async with http.post(f"{sim.url}/v1/chat/completions", json=body,
                         headers={"X-Request-Id": "abc"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        data = await _sse(resp)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    for c in chunks:
        assert c["id"] == "chatcmpl-abc" and c["object"] == "chat.completion.chunk"
        assert c["model"] == MODEL and isinstance(c["created"], int)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_turn_two_reports_cached_tokens_via_openai_client(sim: SimHandle) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", timeout=10)
    try:
        messages: list[Any] = [{"role": "user", "content": LONG_TEXT}]
        first = await client.chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=8)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        reply = first.choices[0].message.content
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "and then?"}]
        second = await client.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=8)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens
        n1 = first.usage.prompt_tokens
        assert cached is not None and cached >= (n1 // 16 - 1) * 16 and cached % 16 == 0
        assert cached < second.usage.prompt_tokens
    finally:
        await client.close()


async def test_completions_stream_and_non_stream(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 3}
    async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
        full = await resp.json()
    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 3
    async with http.post(f"{sim.url}/v1/completions", json={**body, "stream": True}) as resp:
        data = await _sse(resp)
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


async def test_tokenize_render_models_health(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/tokenize",
                         json={"model": MODEL, "prompt": "hello there",
                               "return_token_strs": True}) as resp:
        tok = await resp.json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert tok["token_strs"][0] == "<|begin_of_text|>"
    chat = _chat("hello")
    async with http.post(f"{sim.url}/tokenize", json=chat) as resp:
        chat_tok = await resp.json()
    async with http.post(f"{sim.url}/v1/chat/completions/render", json=chat) as resp:
        rendered = await resp.json()
    assert rendered["token_ids"] == chat_tok["tokens"]
    async with http.post(f"{sim.url}/v1/completions/render",
                         json={"model": MODEL, "prompt": "hello there"}) as resp:
        (crendered,) = await resp.json()
    assert crendered["token_ids"] == tok["tokens"]
    async with http.get(f"{sim.url}/v1/models") as resp:
        models = await resp.json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["owned_by"] == "vllm"
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""


async def test_errors_have_vllm_shape(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/v1/chat/completions",
                         json={**_chat("x"), "model": "nope"}) as resp:
        assert resp.status == 404
        err = (await resp.json())["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404 and "nope" in err["message"]
    async with http.post(f"{sim.url}/v1/chat/completions",
                         json=_chat("x", stream_options={"include_usage": True})) as resp:
        assert resp.status == 400
    async with http.post(f"{sim.url}/v1/chat/completions",
                         json=_chat("x", cache_salt="a/b")) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "cache_salt"
    async with http.post(f"{sim.url}/v1/chat/completions",
                         json=_chat("x", max_tokens=10**7)) as resp:
        assert resp.status == 400


async def test_metrics_and_event_sources(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(LONG_TEXT)) as resp:
        await resp.read()
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(LONG_TEXT)) as resp:
        await resp.read()
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert f'{name}{{' in text, name
    assert f'model_name="{MODEL}"' in text and 'engine="0"' in text
    assert 'vllm:cache_config_info{block_size="16"' in text and 'num_gpu_blocks="256"' in text
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) > 0
    async with http.get(f"{sim.url}/kv_event_sources") as resp:
        sources = await resp.json()
    cfg = sources["0"]
    assert cfg["endpoint"] == sim.kv_events_endpoint and cfg["topic"] == "kv@sim@m"
    assert cfg["replay_endpoint"] == sim.replay_endpoint and cfg["publisher"] == "zmq"
    assert cfg["enable_kv_cache_events"] is True


async def _recv(sub: zmq.asyncio.Socket) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sub.recv_multipart(), 5)
    return frames


async def test_events_on_a_real_sub_socket_and_replay(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@sim")
        assert sim.kv_events_endpoint and sim.replay_endpoint
        sub.connect(sim.kv_events_endpoint)
        await asyncio.sleep(0.2)  # slow joiner
        body = _chat(LONG_TEXT, cache_salt="tenant-1", max_tokens=1)  # one step, one batch
        async with http.post(f"{sim.url}/tokenize", json=body) as resp:
            prompt = (await resp.json())["tokens"]
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        topic, seq, payload = await _recv(sub)
        assert topic == b"kv@sim@m" and len(seq) == 8 and int.from_bytes(seq, "big") == 0
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
        assert raw[1][0]["type"] == "BlockStored"  # 0.24+ tagged map
        batch = decode_batch(payload)
        (stored,) = batch.events
        assert isinstance(stored, StoredEvent)
        n_full = len(prompt) // 16
        assert stored.token_ids == prompt[: n_full * 16]
        assert stored.parent_block_hash is None and stored.block_size == 16
        assert stored.extra_keys is not None and list(stored.extra_keys[0]) == ["tenant-1"]
        ours = block_keys(prompt, 16, model=MODEL, cache_salt="tenant-1")
        assert not set(stored.block_hashes) & set(ours)  # engine hashes are not our keys
        # Replay from 0 over a DEALER: the batch again, then the end marker.
        dealer.connect(sim.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert frames == [b"", b"kv@sim@m", seq, payload]
        end = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert end[-1] == b"" and end[-2] == b"\xff" * 8
        # A reset on an idle engine publishes nothing yet: like vLLM 0.32, the
        # AllBlocksCleared goes out first in the next step's batch, with the next seq.
        async with http.post(f"{sim.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        assert not await sub.poll(300)
        async with http.post(f"{sim.url}/v1/chat/completions", json=_chat(LONG_TEXT)) as resp:
            assert resp.status == 200
        _, seq1, payload1 = await _recv(sub)
        assert int.from_bytes(seq1, "big") == 1
        assert isinstance(decode_batch(payload1).events[0], ClearedEvent)
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


async def test_legacy_encoding_option(tokenizer_dir: Path, http: aiohttp.ClientSession) -> None:
    async with start_sim(tokenizer_dir, model=MODEL, time_scale=0.01,
                         legacy_encoding=True) as handle:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            assert handle.kv_events_endpoint
            sub.connect(handle.kv_events_endpoint)
            await asyncio.sleep(0.2)
            async with http.post(f"{handle.url}/v1/chat/completions",
                                 json=_chat(LONG_TEXT)) as resp:
                assert resp.status == 200
            _, _, payload = await _recv(sub)
            raw = msgspec.msgpack.decode(payload)
            assert raw[1][0][0] == "BlockStored"  # tagged array
            assert isinstance(decode_batch(payload).events[0], StoredEvent)
        finally:
            sub.close(0)
            ctx.term()


async def _set_faults(http: aiohttp.ClientSession, url: str, **spec: Any) -> None:
    async with http.post(f"{url}/sim/faults", json=spec) as resp:
        assert resp.status == 200, await resp.text()


async def test_fault_5xx_and_slow_first_token(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    await _set_faults(http, sim.url, error_status=503, error_count=1)
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat("x")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503
    async with http.post(f"{sim.url}/v1/chat/completions", json=_chat("x")) as resp:
        assert resp.status == 200
    await _set_faults(http, sim.url, slow_first_token_s=0.4)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(f"{sim.url}/v1/chat/completions",
                         json=_chat("x", stream=True)) as resp:
        await resp.content.readline()
        assert loop.time() - t0 >= 0.4
    async with http.post(f"{sim.url}/sim/faults", json={"bogus": 1}) as resp:
        assert resp.status == 400


async def test_fault_hang_then_recover(sim: SimHandle, http: aiohttp.ClientSession) -> None:
    await _set_faults(http, sim.url, hang=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(f"{sim.url}/health",
                            timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
            await resp.read()
    await _set_faults(http, sim.url, hang=False)
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


async def test_fault_dropped_events_leave_a_gap_replay_fills(
    sim: SimHandle, http: aiohttp.ClientSession
) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert sim.kv_events_endpoint and sim.replay_endpoint
        sub.connect(sim.kv_events_endpoint)
        await asyncio.sleep(0.2)
        await _set_faults(http, sim.url, drop_events=1)
        for text in (LONG_TEXT, "another prompt " * 20):
            async with http.post(f"{sim.url}/v1/chat/completions",
                                 json=_chat(text, max_tokens=1)) as resp:
                assert resp.status == 200
        _, seq, _ = await _recv(sub)
        assert int.from_bytes(seq, "big") == 1  # batch 0 was dropped live
        dealer.connect(sim.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert int.from_bytes(frames[2], "big") == 0
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


async def test_fault_crash_drops_the_replica(tokenizer_dir: Path) -> None:
    async with start_sim(tokenizer_dir, model=MODEL, time_scale=0.01) as handle, \
            aiohttp.ClientSession(timeout=TIMEOUT) as http:
        await _set_faults(http, handle.url, crash=True)
        await asyncio.sleep(0.2)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"{handle.url}/health") as resp:
                await resp.read()


async def test_lora_adapter_is_served_and_isolated(
    tokenizer_dir: Path, http: aiohttp.ClientSession
) -> None:
    async with start_sim(tokenizer_dir, model=MODEL, time_scale=0.01,
                         lora_modules=("adapter-a",)) as handle:
        async with http.get(f"{handle.url}/v1/models") as resp:
            cards = (await resp.json())["data"]
        assert [c["id"] for c in cards] == [MODEL, "adapter-a"]
        assert cards[1]["parent"] == MODEL
        body = _chat(LONG_TEXT, model="adapter-a", max_tokens=1)
        async with http.post(f"{handle.url}/v1/chat/completions", json=body) as resp:
            first = await resp.json()
        assert first["model"] == "adapter-a"
        base = _chat(LONG_TEXT, max_tokens=1)
        async with http.post(f"{handle.url}/v1/chat/completions", json=base) as resp:
            other = await resp.json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post(f"{handle.url}/v1/chat/completions", json=body) as resp:
            again = await resp.json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_cpu_offload_events_and_host_hits(
    tokenizer_dir: Path, http: aiohttp.ClientSession
) -> None:
    cfg = EngineConfig(model=MODEL, num_blocks=1 + 40, time_scale=0.01, cpu_offload_blocks=200)
    async with start_sim(tokenizer_dir, model=MODEL, engine=cfg) as handle:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            assert handle.kv_events_endpoint
            sub.connect(handle.kv_events_endpoint)
            await asyncio.sleep(0.2)
            first = _chat(LONG_TEXT, max_tokens=1)
            other = _chat("unrelated words " * 40, max_tokens=1)  # ~410 tokens
            for body in (first, other, first):  # ~430 + ~410 tokens > 640 in the pool
                async with http.post(f"{handle.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    last = await resp.json()
            # The second prompt evicted the first's tail blocks from the GPU; the host tier
            # serves them back, so the whole prompt (but its last token) is a hit again.
            n = last["usage"]["prompt_tokens"]
            assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
            assert handle.engine.scheduler.stats.prefix_hits < (n - 1) // 16 * 16
            media = set()
            while True:
                try:
                    _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 0.5)
                except TimeoutError:
                    break
                for ev in decode_batch(payload).events:
                    if not isinstance(ev, ClearedEvent):
                        media.add((type(ev).__name__, str(ev.medium)))
            assert ("StoredEvent", "CPU") in media and ("RemovedEvent", "GPU") in media
        finally:
            sub.close(0)
            ctx.term()


async def test_engine_death_fails_requests_and_health(
    tokenizer_dir: Path, http: aiohttp.ClientSession
) -> None:
    async with start_sim(tokenizer_dir, model=MODEL, time_scale=1.0) as handle:
        sched = handle.engine.scheduler

        def broken(plan: StepPlan, now: float) -> list[SimRequest]:
            raise RuntimeError("injected engine bug")

        async def long_request() -> tuple[int, dict[str, Any]]:
            async with http.post(f"{handle.url}/v1/chat/completions",
                                 json=_chat("x", max_tokens=500)) as resp:
                return resp.status, await resp.json()

        task = asyncio.create_task(long_request())
        while not sched.running:
            await asyncio.sleep(0.01)
        sched.finish_step = broken  # type: ignore[method-assign]
        status, body = await asyncio.wait_for(task, 5)
        assert status == 503 and body["error"]["type"] == "EngineDeadError"
        async with http.get(f"{handle.url}/health") as resp:
            assert resp.status == 503
