"""Generation on the simulated replica: ``POST /v1/chat/completions`` and
``/v1/completions``, streaming (vLLM 0.32's SSE chunks, ``stream_options.include_usage``)
or not, with ``usage.prompt_tokens_details.cached_tokens``.  A request is submitted to the
engine and its tokens are relayed as the engine's steps produce them; a client that goes
away aborts it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
import xxhash
from aiohttp import web

from replica.sim.scheduler import SimRequest
from replica.sim.state import HttpError, SimState, error_response, json_response
from replica.sim.validation import generation_length, parse_body, prompt_ids

__all__ = ["Generation"]


class Generation:
    """The generation handlers of one replica."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register the two generation routes on ``router``."""
        router.add_post("/v1/chat/completions", self._chat)
        router.add_post("/v1/completions", self._completions)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        await self.state.gate()
        if self.state.engine_dead:
            return error_response(503, "The engine is dead", "EngineDeadError")
        status = self.state.faults.take_error()
        if status is not None:
            return error_response(status, "Simulated failure", "InternalServerError")
        try:
            body = await parse_body(self.state, request)
            ids = prompt_ids(self.state, body, chat)
            max_tokens = generation_length(self.state, body, chat, len(ids))
        except HttpError as e:
            return error_response(e.status, e.message, e.err_type, e.param)
        base = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        seed = body.get("seed")
        seed_val = xxhash.xxh3_64_intdigest(bytes(str(ids), "ascii")) ^ (
            seed if isinstance(seed, int) else 0
        )
        wake = asyncio.Event()

        def on_output(_: SimRequest) -> None:
            wake.set()

        salt = body.get("cache_salt")
        model = body.get("model")
        lora = model if model in self.state.settings.lora_modules else None
        sched = self.state.engine.scheduler
        req = SimRequest(
            rid, ids, max_tokens, keys=sched.make_keys(ids, cache_salt=salt, lora_name=lora),
            cache_salt=salt, lora_name=lora, seed=seed_val, on_output=on_output,
            stream=bool(body.get("stream")),
        )
        self.state.engine.submit(req)
        self.state.waiters.add(wake)
        try:
            if body.get("stream"):
                return await self._stream(request, req, wake, body, chat)
            while not req.finished:
                wake.clear()
                await wake.wait()
                if self.state.engine_dead:
                    return error_response(503, "The engine is dead", "EngineDeadError")
            if self.state.faults.slow_first_token_s > 0:
                await asyncio.sleep(self.state.faults.slow_first_token_s)
            return json_response(self._full_body(req, chat, _wants_timing(body)))
        finally:
            self.state.waiters.discard(wake)
            if not req.finished and not self.state.engine_dead:
                self.state.engine.abort(req)

    def _usage(self, req: SimRequest, timing: bool = False) -> dict[str, Any]:
        n_out = req.num_output
        usage: dict[str, Any] = {
            "prompt_tokens": req.num_prompt,
            "total_tokens": req.num_prompt + n_out,
            "completion_tokens": n_out,
        }
        if self.state.settings.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": max(req.num_cached_tokens, 0)}
        if timing and req.first_token_s is not None:
            # Opt-in (body ``vllm_xargs.kvroute_sim_timing``), for kvroute's benchmark: the
            # TTFT in simulated seconds, free of the wall-clock HTTP overhead that a time
            # scale would magnify, and which replica served (behind routers that do not
            # say).  Not a vLLM field.
            usage["kvroute_sim"] = {"ttft_s": round(req.first_token_s - req.arrival_s, 6),
                                    "replica": self.state.url}
        return usage

    def _text(self, ids: list[int]) -> str:
        piece = self.state.renderer.piece
        return "".join([piece(t) for t in ids])

    def _full_body(self, req: SimRequest, chat: bool, timing: bool = False) -> dict[str, Any]:
        text = self._text(req.output_ids)
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant", "content": text, "refusal": None,
                    "annotations": None, "audio": None, "function_call": None,
                    "tool_calls": [], "reasoning": None,
                },
                "logprobs": None, "finish_reason": "length", "stop_reason": None,
                "token_ids": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            obj = "text_completion"
        usage = self._usage(req, timing)
        if self.state.settings.enable_prompt_tokens_details:
            usage["prompt_tokens_details"].update(
                {"created_cache_tokens": None, "multimodal_tokens": None}
            )
        return {
            "id": req.request_id, "object": obj, "created": created,
            "model": req.lora_name or self.state.settings.model, "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": None, "kv_transfer_params": None,
        }

    async def _stream(
        self, request: web.Request, req: SimRequest, wake: asyncio.Event,
        body: Mapping[str, Any], chat: bool,
    ) -> web.StreamResponse:
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        await resp.prepare(request)
        created = int(time.time())
        model = req.lora_name or self.state.settings.model
        rid = req.request_id
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = b'{"id":' + orjson.dumps(rid) + b',"object":"' + obj.encode() + \
            b'","created":' + str(created).encode() + b',"model":' + orjson.dumps(model)
        sent = 0
        first = True
        while True:
            while req.num_output == sent and not req.finished:
                wake.clear()
                await wake.wait()
                if self.state.engine_dead:  # after the first byte: an error event, then close
                    await resp.write(b'data: {"error": {"message": "The engine is dead", '
                                     b'"type": "EngineDeadError", "param": null, '
                                     b'"code": 503}}\n\n')
                    await resp.write_eof()
                    return resp
            if first and self.state.faults.slow_first_token_s > 0:
                await asyncio.sleep(self.state.faults.slow_first_token_s)
            out = bytearray()
            if first and chat:
                out += b"data: " + head + (
                    b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}],'
                    b'"prompt_token_ids":null,"prompt_text":null}\n\n'
                )
            first = False
            new = req.tokens[req.num_prompt + sent :]
            sent += len(new)
            text = orjson.dumps(self._text(new))
            done = req.finished and sent >= req.num_output
            tail = (b',"finish_reason":"length","stop_reason":null' if done
                    else b',"finish_reason":null')
            if chat:
                choice = (b'{"index":0,"delta":{"content":' + text + b'},"logprobs":null'
                          + tail + b',"token_ids":null}')
            else:
                choice = (b'{"index":0,"text":' + text + b',"logprobs":null'
                          + (tail if done else tail + b',"stop_reason":null')
                          + b',"prompt_token_ids":null,"token_ids":null}')
            out += b"data: " + head + b',"choices":[' + choice + b"]}\n\n"
            if done:
                if include_usage:
                    out += b"data: " + head + b',"choices":[],"usage":' + orjson.dumps(
                        self._usage(req, _wants_timing(body))
                    ) + b"}\n\n"
                out += b"data: [DONE]\n\n"
                await resp.write(bytes(out))
                break
            await resp.write(bytes(out))
        await resp.write_eof()
        return resp


def _wants_timing(body: Mapping[str, Any]) -> bool:
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and bool(xargs.get("kvroute_sim_timing"))
