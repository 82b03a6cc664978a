"""Request checks of the simulated replica, with vLLM 0.32's messages, types and params.

Each function raises ``HttpError`` (``replica.sim.state``) for what vLLM refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from replica.sim.render import RenderError
from replica.sim.state import HttpError, SimState

__all__ = ["generation_length", "parse_body", "prompt_ids"]

_SALT_FORBIDDEN = set("@/\\\x00")
_MAX_TOKEN_ID = 2**32 - 1
"""No vocabulary reaches past the ids block hashes pack as u32."""


async def parse_body(state: SimState, request: web.Request) -> dict[str, Any]:
    """The request's JSON object, checked as vLLM checks it (model, cache_salt, n, ...)."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise HttpError(400, "The request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.settings.model and \
            model not in state.settings.lora_modules:
        raise HttpError(
            404, f"The model `{model}` does not exist. Valid aliases: {state.settings.model}.",
            "NotFoundError", "model",
        )
    salt = body.get("cache_salt")
    if salt is not None and (
        not isinstance(salt, str) or not salt or len(salt) > 128
        or any(c in _SALT_FORBIDDEN for c in salt)
    ):
        raise HttpError(
            400,
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters"
            " and must not contain '@', '/', '\\', or NUL.",
            "BadRequestError", "cache_salt",
        )
    n = body.get("n", 1)
    if n not in (None, 1):
        raise HttpError(400, "the simulated replica only serves n=1", "BadRequestError", "n")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise HttpError(400, "Stream options can only be defined when `stream=True`.",
                         "BadRequestError", "stream_options")
    return body

def prompt_ids(state: SimState, body: Mapping[str, Any], chat: bool) -> list[int]:
    """The prompt's token ids, refused when empty or longer than the model allows."""
    try:
        render = state.renderer.render_chat if chat else state.renderer.render_completion
        ids = render(body)
    except RenderError as exc:
        raise HttpError(400, str(exc), "BadRequestError", exc.param) from exc
    if not ids:
        raise HttpError(400, "The prompt must not be empty", "BadRequestError", "prompt")
    low, high = min(ids), max(ids)
    if high > _MAX_TOKEN_ID or low < 0:
        # vLLM's refusal of ids past its vocabulary; hashing them would kill the engine
        bad = high if high > _MAX_TOKEN_ID else low
        raise HttpError(400, f"Token id {bad} is out of vocabulary", "BadRequestError",
                        "prompt")
    limit = state.engine.max_model_len
    if len(ids) >= limit:
        raise HttpError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt"
            f" contains {len(ids)} input tokens, which exceeds this limit even without any"
            " output tokens. Please reduce the length of the input prompt.",
            "BadRequestError", "input_tokens",
        )
    return ids

def generation_length(state: SimState, body: Mapping[str, Any], chat: bool, n_prompt: int) -> int:
    """The generation length: the request's, checked, or vLLM's default."""
    limit = state.engine.max_model_len
    value = body.get("max_completion_tokens") if chat else None
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return limit - n_prompt if chat else min(16, limit - n_prompt)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HttpError(400, f"max_tokens must be at least 1, got {value}.",
                         "BadRequestError", "max_tokens")
    if value > limit - n_prompt:
        raise HttpError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {value}. This model's"
            f" maximum context length is {limit} tokens and your request has {n_prompt}"
            f" input tokens ({value} > {limit} - {n_prompt}).",
            "BadRequestError", "max_tokens",
        )
    return value
