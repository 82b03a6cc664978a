"""Fields of an OpenAI request body that rendering reads, checked as vLLM checks them.

Each function raises ``InvalidPrompt`` (HTTP 400, with the field as ``param``) for a value
vLLM would refuse.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from prompt.errors import InvalidPrompt

__all__ = [
    "completion_items",
    "dump_tools",
    "flag",
    "merge_kwargs",
    "truncate_prompt_tokens",
    "truncation_side",
]


def merge_kwargs(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: overrides win unless they are ``None`` or ``"auto"``."""
    merged = dict(defaults)
    for key, value in overrides.items():
        if not _is_unset(value):
            merged[key] = value
    return merged


def _is_unset(value: object) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def dump_tools(tools: object) -> list[dict[str, Any]] | None:
    """Tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` hands them to templates."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidPrompt("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidPrompt("each tool must be a function tool", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidPrompt("each tool needs function.name", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidPrompt("function.parameters must be an object", param="tools")
        defer = tool.get("defer_loading")
        fn_defer = fn.get("defer_loading")
        if fn_defer is None and defer is not None:
            fn_defer = defer
        dumped_fn: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": copy.deepcopy(params),
        }
        if fn.get("strict") is not None:
            dumped_fn["strict"] = fn["strict"]
        if fn_defer is not None:
            dumped_fn["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean request field (``None`` or absent: ``default``)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidPrompt(f"'{name}' must be a boolean", param=name)
    return value


def truncate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """``truncate_prompt_tokens``: ``None``, ``-1`` (the model length) or a count."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidPrompt(
            "truncate_prompt_tokens must be an integer >= -1", param="truncate_prompt_tokens"
        )
    return value


def truncation_side(body: Mapping[str, Any]) -> Literal["left", "right"] | None:
    """``truncation_side``, if the request sets it."""
    value = body.get("truncation_side")
    if value is None:
        return None
    if value not in ("left", "right"):
        raise InvalidPrompt(
            "`truncation_side` must be either 'left' or 'right'.", param="truncation_side"
        )
    return "left" if value == "left" else "right"


def completion_items(prompt: object) -> list[str | Sequence[int]]:
    """A completions ``prompt`` as its items: texts or token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token(p) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return list(prompt)
    if prompt is None or prompt == []:
        raise InvalidPrompt("Either prompt or prompt_embeds must be provided.", param="prompt")
    raise InvalidPrompt(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists",
        param="prompt",
    )


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
