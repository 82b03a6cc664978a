"""The simulated replica's endpoints other than generation: ``/health``, ``/version``,
``/v1/models``, ``/kv_event_sources``, ``/metrics``, ``/reset_prefix_cache``,
``/sim/faults``, ``/tokenize``, ``/detokenize`` and the ``/render`` pair, shaped as vLLM
0.32's ``entrypoints`` answer them."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from aiohttp import web

from replica.sim.faults import FaultSpecError
from replica.sim.metrics import CONTENT_TYPE
from replica.sim.state import HttpError, SimState, error_response, json_response
from replica.sim.validation import generation_length, parse_body, prompt_ids

__all__ = ["VLLM_VERSION", "Endpoints"]

VLLM_VERSION = "0.32.0"


class Endpoints:
    """The non-generation handlers of one replica."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register every handler on ``router``."""
        router.add_post("/v1/chat/completions/render", self._render_chat)
        router.add_post("/v1/completions/render", self._render_completion)
        router.add_get("/v1/models", self._models)
        router.add_get("/health", self._health)
        router.add_get("/version", self._version)
        router.add_post("/tokenize", self._tokenize)
        router.add_post("/detokenize", self._detokenize)
        router.add_get("/kv_event_sources", self._kv_event_sources)
        router.add_get("/metrics", self._metrics)
        router.add_post("/reset_prefix_cache", self._reset)
        router.add_get("/sim/faults", self._get_faults)
        router.add_post("/sim/faults", self._post_faults)

    async def _health(self, request: web.Request) -> web.Response:
        await self.state.gate()
        return web.Response(status=503 if self.state.engine_dead else 200)

    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        await self.state.gate()
        s = self.state.settings
        card = {
            "id": s.model, "object": "model", "created": self.state.created, "owned_by": "vllm",
            "root": s.model, "parent": None, "max_model_len": self.state.engine.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                "created": self.state.created, "allow_create_engine": False,
                "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }
        cards = [card]
        for name in s.lora_modules:
            cards.append({**card, "id": name, "root": f"/sim/loras/{name}", "parent": s.model})
        return json_response({"object": "list", "data": cards})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        if self.state.publisher is None:
            return json_response({})
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.state.kv_events_endpoint,
            "replay_endpoint": self.state.replay_endpoint,
            "buffer_steps": self.state.settings.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.state.settings.topic,
        }
        return json_response({"0": cfg})

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.state.gate()
        return web.Response(body=self.state.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def _reset(self, request: web.Request) -> web.Response:
        ok = self.state.engine.reset_prefix_cache()
        return json_response({"success": ok}, 200 if ok else 409)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.state.faults.as_dict())

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            spec = orjson.loads(await request.read())
            if not isinstance(spec, dict):
                raise FaultSpecError("body must be a JSON object")
            self.state.faults.update(spec)
        except (orjson.JSONDecodeError, FaultSpecError) as exc:
            return error_response(400, str(exc), "BadRequestError")
        if self.state.faults.crash:
            self.state.crash()
        return json_response(self.state.faults.as_dict())

    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, *, chat: bool) -> web.Response:
        await self.state.gate()
        try:
            body = await parse_body(self.state, request)
            ids = prompt_ids(self.state, body, chat)
            max_tokens = generation_length(self.state, body, chat, len(ids))
        except HttpError as e:
            return error_response(e.status, e.message, e.err_type, e.param)
        gen = {
            "request_id": str(body.get("request_id") or uuid.uuid4().hex),
            "token_ids": ids,
            "features": None,
            "sampling_params": {"max_tokens": max_tokens, "n": 1},
            "model": body.get("model") or self.state.settings.model,
            "stream": bool(body.get("stream", False)),
            "cache_salt": body.get("cache_salt"),
            "priority": int(body.get("priority", 0) or 0),
        }
        return json_response(gen if chat else [gen])

    async def _tokenize(self, request: web.Request) -> web.Response:
        await self.state.gate()
        try:
            body = await parse_body(self.state, request)
            chat = "messages" in body
            ids = prompt_ids(self.state, body, chat)
        except HttpError as e:
            return error_response(e.status, e.message, e.err_type, e.param)
        out: dict[str, Any] = {
            "count": len(ids), "max_model_len": self.state.engine.max_model_len, "tokens": ids,
            "token_strs": None,
        }
        if body.get("return_token_strs"):
            out["token_strs"] = [self.state.renderer.token_str(t) for t in ids]
        return json_response(out)

    async def _detokenize(self, request: web.Request) -> web.Response:
        await self.state.gate()
        try:
            body = await parse_body(self.state, request)
        except HttpError as e:
            return error_response(e.status, e.message, e.err_type, e.param)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return error_response(400, "'tokens' must be a list of integers", "BadRequestError",
                                  "tokens")
        return json_response({"prompt": self.state.renderer.decode(tokens)})
