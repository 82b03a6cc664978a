"""The simulated replica's HTTP server: vLLM 0.32's OpenAI-compatible surface on aiohttp.

Routes (shapes follow vLLM 0.32's ``entrypoints``): ``POST /v1/chat/completions``,
``POST /v1/completions`` (SSE streaming with vLLM's chunks, ``stream_options.include_usage``,
non-streaming bodies, ``usage.prompt_tokens_details.cached_tokens``),
``GET /v1/models``, ``GET /health``, ``GET /version``, ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/chat/completions/render``, ``POST /v1/completions/render``,
``GET /kv_event_sources``, ``GET /metrics``, ``POST /reset_prefix_cache``, and the
simulator's own ``GET|POST /sim/faults``.  Errors use vLLM's body
``{"error": {"message", "type", "param", "code"}}``.

Lifecycle: ``SimServer.start()`` opens the event publisher, starts the engine task and
binds the listener; ``aclose()`` undoes them in reverse.  ``start_sim(...)`` wraps both
as an async context manager for tests and benchmarks.  Several servers can share one
event loop (the fleet benchmark runs sixteen).

Time: engine timing is simulated (``time_scale``), but ``created`` stamps are wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import xxhash
from aiohttp import web

from replica.sim.engine import EngineConfig, SimEngine
from replica.sim.event_sink import PublisherSink
from replica.sim.faults import Faults, FaultSpecError
from replica.sim.kv_publisher import KVEventPublisher
from replica.sim.metrics import CONTENT_TYPE, SimMetrics
from replica.sim.render import PromptRenderer, RenderError, TokenizerRenderer
from replica.sim.scheduler import SimRequest

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
_SALT_FORBIDDEN = set("@/\\\x00")


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Everything ``kvroute sim`` takes on its command line."""

    model: str
    tokenizer: str
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig | None = None
    kv_events: bool = True
    kv_events_endpoint: str | None = None
    """PUB endpoint; ``None`` binds a free loopback port (reported at ``/kv_event_sources``)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint; ``None`` binds a free loopback port."""
    topic: str = ""
    legacy_encoding: bool = False
    legacy_replay: bool = False
    buffer_steps: int = 10_000
    enable_prompt_tokens_details: bool = True
    lora_modules: tuple[str, ...] = ()
    """LoRA adapter names served besides the base model (their blocks carry the name)."""
    faults: Faults = field(default_factory=Faults)

    def engine_config(self) -> EngineConfig:
        """The engine configuration (defaults filled in)."""
        return self.engine if self.engine is not None else EngineConfig(model=self.model)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


class SimServer:
    """One simulated vLLM replica (engine + publisher + HTTP)."""

    def __init__(
        self,
        settings: SimSettings,
        *,
        renderer: PromptRenderer | None = None,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.faults = settings.faults
        self.renderer: PromptRenderer = renderer or TokenizerRenderer(settings.tokenizer)
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events:
            ep = settings.kv_events_endpoint
            self.publisher = KVEventPublisher(
                ep or f"tcp://{settings.host}:0",
                replay_endpoint=settings.replay_endpoint or f"tcp://{settings.host}:0",
                topic=settings.topic,
                buffer_steps=settings.buffer_steps,
                data_parallel_rank=0,
                legacy_encoding=settings.legacy_encoding,
                legacy_replay=settings.legacy_replay,
                bind=True if ep is None else None,
            )
        sink = PublisherSink(self.publisher, self.faults) if self.publisher else None
        self.engine = SimEngine(settings.engine_config(), self.renderer.sample_vocab(), sink=sink)
        self.metrics = SimMetrics(self.engine, settings.model)
        self._on_crash = on_crash
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._never = asyncio.Event()
        self._crashed = False
        self._engine_dead = False
        self._waiters: set[asyncio.Event] = set()
        self.port = settings.port
        self.created = int(time.time())

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8001``."""
        return f"http://{self.settings.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The resolved PUB endpoint (``None`` without events)."""
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        """The resolved replay (ROUTER) endpoint."""
        return self.publisher.resolved_replay_endpoint if self.publisher else None

    async def start(self) -> None:
        """Open the publisher, start the engine, bind HTTP."""
        if self.publisher is not None:
            await self.publisher.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name="sim-engine")
        self._engine_task.add_done_callback(self._engine_done)
        app = self._build_app()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.settings.host, self.settings.port,
                                 backlog=1024)
        await self._site.start()
        server = self._site._server
        sockets = getattr(server, "sockets", None)
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stop HTTP, then the engine, then the publisher (idempotent)."""
        self._never.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        task, self._engine_task = self._engine_task, None
        if task is not None and not task.done():  # a dead engine was reported already
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.publisher is not None:
            await self.publisher.aclose()

    async def kill(self) -> None:
        """Die abruptly: drop every connection and stop (the in-process ``crash``)."""
        self._crashed = True
        runner = self._runner
        if runner is not None and runner.server is not None:
            for conn in list(runner.server.connections):
                transport = conn.transport
                if transport is not None:
                    transport.abort()
        await self.aclose()

    def _engine_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # Like vLLM's EngineDeadError: /health turns 503 and generation fails.
            self._engine_dead = True
            log.error("simulated engine died", exc_info=exc)
            for wake in self._waiters:
                wake.set()

    def _crash(self) -> None:
        if self._on_crash is not None:
            self._on_crash()
            return
        asyncio.get_running_loop().create_task(self.kill())

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        r.add_post("/v1/completions/render", self._render_completion)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/version", self._version)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_get("/kv_event_sources", self._kv_event_sources)
        r.add_get("/metrics", self._metrics)
        r.add_post("/reset_prefix_cache", self._reset)
        r.add_get("/sim/faults", self._get_faults)
        r.add_post("/sim/faults", self._post_faults)
        return app

    # ---- fault gate ----------------------------------------------------------------

    async def _gate(self) -> None:
        if self.faults.crash and not self._crashed:
            self._crashed = True
            self._crash()
        if self.faults.hang or self._crashed:
            await self._never.wait()
            raise web.HTTPServiceUnavailable()

    # ---- simple routes -------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        await self._gate()
        return web.Response(status=503 if self._engine_dead else 200)

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        await self._gate()
        s = self.settings
        card = {
            "id": s.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": s.model, "parent": None, "max_model_len": self.engine.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                "created": self.created, "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }
        cards = [card]
        for name in s.lora_modules:
            cards.append({**card, "id": name, "root": f"/sim/loras/{name}", "parent": s.model})
        return _json({"object": "list", "data": cards})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        if self.publisher is None:
            return _json({})
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.settings.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.settings.topic,
        }
        return _json({"0": cfg})

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._gate()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _reset(self, request: web.Request) -> web.Response:
        ok = self.engine.reset_prefix_cache()
        return _json({"success": ok}, 200 if ok else 409)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json(self.faults.as_dict())

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            spec = orjson.loads(await request.read())
            if not isinstance(spec, dict):
                raise FaultSpecError("body must be a JSON object")
            self.faults.update(spec)
        except (orjson.JSONDecodeError, FaultSpecError) as exc:
            return _error(400, str(exc), "BadRequestError")
        if self.faults.crash:
            self._crashed = True
            self._crash()
        return _json(self.faults.as_dict())

    # ---- parsing -------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise _HttpError(400, f"Invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise _HttpError(400, "The request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.settings.model and \
                model not in self.settings.lora_modules:
            raise _HttpError(
                404, f"The model `{model}` does not exist. Valid aliases: {self.settings.model}.",
                "NotFoundError", "model",
            )
        salt = body.get("cache_salt")
        if salt is not None and (
            not isinstance(salt, str) or not salt or len(salt) > 128
            or any(c in _SALT_FORBIDDEN for c in salt)
        ):
            raise _HttpError(
                400,
                "Parameter 'cache_salt' must be a non-empty string of at most 128 characters"
                " and must not contain '@', '/', '\\', or NUL.",
                "BadRequestError", "cache_salt",
            )
        n = body.get("n", 1)
        if n not in (None, 1):
            raise _HttpError(400, "the simulated replica only serves n=1", "BadRequestError", "n")
        if body.get("stream_options") is not None and not body.get("stream"):
            raise _HttpError(400, "Stream options can only be defined when `stream=True`.",
                             "BadRequestError", "stream_options")
        return body

    def _prompt(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        try:
            ids = self.renderer.render_chat(body) if chat else self.renderer.render_completion(body)
        except RenderError as exc:
            raise _HttpError(400, str(exc), "BadRequestError", exc.param) from exc
        if not ids:
            raise _HttpError(400, "The prompt must not be empty", "BadRequestError", "prompt")
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise _HttpError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt"
                f" contains {len(ids)} input tokens, which exceeds this limit even without any"
                " output tokens. Please reduce the length of the input prompt.",
                "BadRequestError", "input_tokens",
            )
        return ids

    def _max_tokens(self, body: Mapping[str, Any], chat: bool, n_prompt: int) -> int:
        limit = self.engine.max_model_len
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        if value is None:
            return limit - n_prompt if chat else min(16, limit - n_prompt)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _HttpError(400, f"max_tokens must be at least 1, got {value}.",
                             "BadRequestError", "max_tokens")
        if value > limit - n_prompt:
            raise _HttpError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {value}. This model's"
                f" maximum context length is {limit} tokens and your request has {n_prompt}"
                f" input tokens ({value} > {limit} - {n_prompt}).",
                "BadRequestError", "max_tokens",
            )
        return value

    # ---- render / tokenize ---------------------------------------------------------

    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, *, chat: bool) -> web.Response:
        await self._gate()
        try:
            body = await self._body(request)
            ids = self._prompt(body, chat)
            max_tokens = self._max_tokens(body, chat, len(ids))
        except _HttpError as e:
            return _error(e.status, e.message, e.err_type, e.param)
        gen = {
            "request_id": str(body.get("request_id") or uuid.uuid4().hex),
            "token_ids": ids,
            "features": None,
            "sampling_params": {"max_tokens": max_tokens, "n": 1},
            "model": body.get("model") or self.settings.model,
            "stream": bool(body.get("stream", False)),
            "cache_salt": body.get("cache_salt"),
            "priority": int(body.get("priority", 0) or 0),
        }
        return _json(gen if chat else [gen])

    async def _tokenize(self, request: web.Request) -> web.Response:
        await self._gate()
        try:
            body = await self._body(request)
            chat = "messages" in body
            ids = self._prompt(body, chat)
        except _HttpError as e:
            return _error(e.status, e.message, e.err_type, e.param)
        out: dict[str, Any] = {
            "count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [self.renderer.token_str(t) for t in ids]
        return _json(out)

    async def _detokenize(self, request: web.Request) -> web.Response:
        await self._gate()
        try:
            body = await self._body(request)
        except _HttpError as e:
            return _error(e.status, e.message, e.err_type, e.param)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return _error(400, "'tokens' must be a list of integers", "BadRequestError", "tokens")
        return _json({"prompt": self.renderer.decode(tokens)})

    # ---- generation ----------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        await self._gate()
        if self._engine_dead:
            return _error(503, "The engine is dead", "EngineDeadError")
        status = self.faults.take_error()
        if status is not None:
            return _error(status, "Simulated failure", "InternalServerError")
        try:
            body = await self._body(request)
            ids = self._prompt(body, chat)
            max_tokens = self._max_tokens(body, chat, len(ids))
        except _HttpError as e:
            return _error(e.status, e.message, e.err_type, e.param)
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
        lora = model if model in self.settings.lora_modules else None
        sched = self.engine.scheduler
        req = SimRequest(
            rid, ids, max_tokens, keys=sched.make_keys(ids, cache_salt=salt, lora_name=lora),
            cache_salt=salt, lora_name=lora, seed=seed_val, on_output=on_output,
            stream=bool(body.get("stream")),
        )
        self.engine.submit(req)
        self._waiters.add(wake)
        try:
            if body.get("stream"):
                return await self._stream(request, req, wake, body, chat)
            while not req.finished:
                wake.clear()
                await wake.wait()
                if self._engine_dead:
                    return _error(503, "The engine is dead", "EngineDeadError")
            if self.faults.slow_first_token_s > 0:
                await asyncio.sleep(self.faults.slow_first_token_s)
            return _json(self._full_body(req, chat, _wants_timing(body)))
        finally:
            self._waiters.discard(wake)
            if not req.finished and not self._engine_dead:
                self.engine.abort(req)

    def _usage(self, req: SimRequest, timing: bool = False) -> dict[str, Any]:
        n_out = req.num_output
        usage: dict[str, Any] = {
            "prompt_tokens": req.num_prompt,
            "total_tokens": req.num_prompt + n_out,
            "completion_tokens": n_out,
        }
        if self.settings.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": max(req.num_cached_tokens, 0)}
        if timing and req.first_token_s is not None:
            # Opt-in (body ``vllm_xargs.kvroute_sim_timing``), for kvroute's benchmark: the
            # TTFT in simulated seconds, free of the wall-clock HTTP overhead that a time
            # scale would magnify, and which replica served (behind routers that do not
            # say).  Not a vLLM field.
            usage["kvroute_sim"] = {"ttft_s": round(req.first_token_s - req.arrival_s, 6),
                                    "replica": self.url}
        return usage

    def _text(self, ids: list[int]) -> str:
        piece = self.renderer.piece
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
        if self.settings.enable_prompt_tokens_details:
            usage["prompt_tokens_details"].update(
                {"created_cache_tokens": None, "multimodal_tokens": None}
            )
        return {
            "id": req.request_id, "object": obj, "created": created,
            "model": req.lora_name or self.settings.model, "choices": [choice],
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
        model = req.lora_name or self.settings.model
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
                if self._engine_dead:  # after the first byte: an error event, then close
                    await resp.write(b'data: {"error": {"message": "The engine is dead", '
                                     b'"type": "EngineDeadError", "param": null, '
                                     b'"code": 503}}\n\n')
                    await resp.write_eof()
                    return resp
            if first and self.faults.slow_first_token_s > 0:
                await asyncio.sleep(self.faults.slow_first_token_s)
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


@dataclass(frozen=True, slots=True)
class SimHandle:
    """A running in-process simulated replica (what ``start_sim`` yields)."""

    server: SimServer
    url: str
    kv_events_endpoint: str | None
    replay_endpoint: str | None

    @property
    def engine(self) -> SimEngine:
        """The engine (pool, scheduler, stats) for assertions."""
        return self.server.engine

    @property
    def faults(self) -> Faults:
        """The live fault settings."""
        return self.server.faults


@contextlib.asynccontextmanager
async def start_sim(
    tokenizer: str | Path,
    *,
    model: str = "sim-model",
    block_size: int = 16,
    num_blocks: int | None = None,
    profile: str = "default",
    time_scale: float = 1.0,
    seed: int = 0,
    host: str = "127.0.0.1",
    port: int = 0,
    renderer: PromptRenderer | None = None,
    engine: EngineConfig | None = None,
    **settings: Any,
) -> AsyncIterator[SimHandle]:
    """Run a simulated replica on loopback for the duration of the ``async with``.

    Yields a ``SimHandle`` with the base URL and the resolved event endpoints; any other
    ``SimSettings`` field may be passed by keyword (``kv_events_endpoint``, ``topic``,
    ``legacy_encoding``, ``faults``, ...).
    """
    cfg = engine or EngineConfig(
        model=model, block_size=block_size, num_blocks=num_blocks, profile=profile,
        time_scale=time_scale, seed=seed,
    )
    s = SimSettings(model=model, tokenizer=str(tokenizer), host=host, port=port, engine=cfg,
                    **settings)
    server = SimServer(s, renderer=renderer)
    await server.start()
    try:
        yield SimHandle(server, server.url, server.kv_events_endpoint, server.replay_endpoint)
    finally:
        await server.aclose()


def exit_process() -> None:
    """The CLI's ``crash``: die like a killed engine process."""
    os._exit(17)
