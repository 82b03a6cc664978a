"""What decides how a chat body renders: the replica's flags and the request's options.

``RenderOptions`` mirrors the ``vllm serve`` flags that change rendering.
``parse_chat_request`` reads a ``/v1/chat/completions`` body as vLLM does: it checks the
options, re-serialises tools as vLLM's pydantic models dump them (``dump_tools``) and
merges the template kwargs in vLLM's order, lowest priority first (the server's default
kwargs; ``tools``; the request's ``chat_template_kwargs``; the request's
``add_generation_prompt``, ``continue_final_message``, ``documents``,
``reasoning_effort``; a merge ignores ``None`` and ``"auto"``, ``merge_kwargs``).  It
renders nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prompt.errors import InvalidPrompt

ContentFormatOption = Literal["auto", "string", "openai"]


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """The replica's rendering flags for one model (``vllm serve`` equivalents)."""

    chat_template: str | None = None
    """``--chat-template``: a template name of the tokenizer, or a template literal."""
    content_format: ContentFormatOption = "auto"
    """``--chat-template-content-format``."""
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """``--default-chat-template-kwargs``."""
    trust_request_chat_template: bool = False
    """``--trust-request-chat-template``."""
    exclude_tools_when_tool_choice_none: bool = False
    """``--exclude-tools-when-tool-choice-none``."""
    max_model_len: int | None = None
    """Only needed for ``truncate_prompt_tokens=-1``."""
    truncation_side: Literal["left", "right"] = "left"
    """The tokenizer's truncation side in the engine: vLLM's ``get_tokenizer`` forces
    ``"left"`` for generative models, whatever ``tokenizer_config.json`` says."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the stages read of a chat body (parsed and checked once)."""

    messages: object
    kwargs: dict[str, Any]
    """Template kwargs, with ``tools`` and ``chat_template`` (vLLM's merge order)."""
    add_special_tokens: bool
    truncate_prompt_tokens: int | None
    truncation_side: Literal["left", "right"] | None


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


def parse_chat_request(body: Mapping[str, Any], opts: RenderOptions) -> ChatRequest:
    """The body's options, checked and merged in vLLM's order (module docstring)."""
    add_generation_prompt = body_flag(body, "add_generation_prompt", True)
    continue_final = body_flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise InvalidPrompt(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    user_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(user_kwargs, Mapping):
        raise InvalidPrompt(
            "chat_template_kwargs must be an object", param="chat_template_kwargs"
        )
    request_template = body.get("chat_template")
    if not opts.trust_request_chat_template and (
        request_template is not None or user_kwargs.get("chat_template") is not None
    ):
        raise InvalidPrompt(
            "Chat template is passed with request, but --trust-request-chat-template "
            "is not set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    tools = dump_tools(body.get("tools"))
    if body.get("tool_choice") == "none" and opts.exclude_tools_when_tool_choice_none:
        tools = None
    reasoning_effort = body.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "documents": body.get("documents"),
        "reasoning_effort": reasoning_effort,
    }
    if reasoning_effort is not None and "enable_thinking" not in user_kwargs:
        extra["enable_thinking"] = reasoning_effort != "none"
    server = merge_kwargs(opts.default_chat_template_kwargs, {"tools": tools})
    kwargs = merge_kwargs(server, merge_kwargs(user_kwargs, extra))
    template_name = request_template if request_template is not None else opts.chat_template
    kwargs = merge_kwargs(kwargs, {"chat_template": template_name})
    return ChatRequest(
        messages=body.get("messages"),
        kwargs=kwargs,
        add_special_tokens=body_flag(body, "add_special_tokens", False),
        truncate_prompt_tokens=body_truncation(body),
        truncation_side=body_truncation_side(body),
    )


def body_flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean option of the body (``None`` means the default)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidPrompt(f"'{name}' must be a boolean", param=name)
    return value


def body_truncation(body: Mapping[str, Any]) -> int | None:
    """``truncate_prompt_tokens``, checked."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidPrompt(
            "truncate_prompt_tokens must be an integer >= -1", param="truncate_prompt_tokens"
        )
    return value


def body_truncation_side(body: Mapping[str, Any]) -> Literal["left", "right"] | None:
    """``truncation_side``, checked."""
    value = body.get("truncation_side")
    if value is None:
        return None
    if value not in ("left", "right"):
        raise InvalidPrompt(
            "`truncation_side` must be either 'left' or 'right'.", param="truncation_side"
        )
    return "left" if value == "left" else "right"


__all__ = [
    "ChatRequest",
    "ContentFormatOption",
    "RenderOptions",
    "body_flag",
    "body_truncation",
    "body_truncation_side",
    "dump_tools",
    "merge_kwargs",
    "parse_chat_request",
]
