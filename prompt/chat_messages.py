"""OpenAI chat messages to the conversation a chat template sees, as vLLM 0.32 builds it.

The template never sees the request's messages as sent.  vLLM's ``parse_chat_messages``
(``vllm/renderers/chat_utils.py``) rebuilds each one, and these rules change the prompt:

* content ``None`` becomes no parts; a string becomes one text part;
* text parts are ``text``/``input_text``/``output_text`` (``part["text"]``),
  ``refusal`` (``part["refusal"]``) and ``thinking`` (``part["thinking"]``); a bare string
  in the list is a text part; a ``text``/``refusal`` part whose value is missing is
  skipped;
* content format ``"string"``: the texts are joined with ``"\\n"``, empty texts dropped;
  ``"openai"``: every text part becomes ``{"type": "text", "text": ...}`` plus the part's
  unknown keys (so even a string content becomes a one-part list);
* a ``system`` message loses a leading ``x-anthropic-billing-header`` line;
* the rebuilt message carries ``role`` and ``content``, then ``tool_calls`` (assistant,
  when not null), ``reasoning`` and ``reasoning_content`` (assistant, from
  ``reasoning``), ``tool_call_id`` (tool), ``name`` and ``task`` (when strings), ``tools``
  (developer); every other key is dropped;
* a tool message's list content is joined into one string with ``"\\n"`` when all its
  parts are text;
* assistant ``tool_calls``: an empty list is removed; each call must be a function call;
  string ``arguments`` are parsed as JSON, and anything that is not a JSON object
  (including invalid JSON, null, ``""``) becomes ``{}``; keys are ordered as pydantic
  validates them (``id``, ``function``, ``type``, extras; ``arguments``, ``name``).

Images, audio, video and embeddings are not rendered here: they add placeholder tokens
only the engine's processor knows, so they raise ``RenderUnsupported`` (ask a replica).
The request body is never mutated.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from prompt.errors import InvalidPrompt, RenderUnsupported
from prompt.template_env import ContentFormat

Message = dict[str, Any]

_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_IF_MISSING = frozenset({"text", "refusal"})
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_MEDIA_TYPES = frozenset(_MEDIA_KEYS) | {"input_image"}
_BILLING_HEADER = "x-anthropic-billing-header"


def build_conversation(messages: object, content_format: ContentFormat) -> list[Message]:
    """The conversation vLLM renders for ``messages`` (see module doc)."""
    if not isinstance(messages, list):
        raise InvalidPrompt("'messages' must be a list", param="messages")
    conversation = [_message(m, content_format) for m in messages]
    for message in conversation:
        if message["role"] == "assistant" and "tool_calls" in message:
            _normalise_tool_calls(message)
    return conversation


def convert_developer_role(conversation: list[Message]) -> list[Message]:
    """Developer messages become system messages, merged into one at the front (for
    templates that do not mention ``"developer"``)."""
    converted: list[Message] = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    texts: list[str] = []
    rest: list[Message] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or texts:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            pieces: list[str] = []
            for part in content:
                if isinstance(part, dict) and "text" in part:
                    pieces.append(part["text"])
                elif isinstance(part, str):
                    pieces.append(part)
            content = "\n".join(pieces)
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _message(raw: object, content_format: ContentFormat) -> Message:
    if not isinstance(raw, Mapping):
        raise InvalidPrompt("each message must be an object", param="messages")
    role = raw.get("role")
    if not isinstance(role, str):
        raise InvalidPrompt("each message needs a string 'role'", param="messages")
    content = raw.get("content")
    parts: Sequence[Any]
    if type(content) is str and role != "system":  # the common case, kept cheap
        text: str | list[Any] = (
            [{"type": "text", "text": content}] if content_format == "openai" else content
        )
        return _finish(raw, role, {"role": role, "content": text})
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise InvalidPrompt("message 'content' must be a string or a list", param="messages")
    if role == "system":
        parts = _strip_billing_header(parts)
    return _finish(raw, role, {"role": role, "content": _content(parts, content_format)})


def _finish(raw: Mapping[str, Any], role: str, message: Message) -> Message:
    if role == "assistant":
        calls = raw.get("tool_calls")
        if "tool_calls" in raw and calls is not None:
            if not isinstance(calls, list):
                raise InvalidPrompt("'tool_calls' must be a list", param="tool_calls")
            message["tool_calls"] = [_tool_call(c) for c in calls]
        reasoning = raw.get("reasoning")
        if reasoning is not None:
            message["reasoning"] = reasoning
            message["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in raw:
            message["tool_call_id"] = raw["tool_call_id"]
        body = message["content"]
        if isinstance(body, list):
            if not any(isinstance(p, dict) and p.get("type") != "text" for p in body):
                texts = [
                    p.get("text", "")
                    for p in body
                    if isinstance(p, dict) and p.get("type") == "text"
                ]
                message["content"] = "\n".join(texts) if texts else ""
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    if isinstance(raw.get("task"), str):
        message["task"] = raw["task"]
    if role == "developer":
        message["tools"] = copy.deepcopy(raw.get("tools"))
    return message


def _strip_billing_header(parts: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(parts: Sequence[Any], content_format: ContentFormat) -> str | list[Any]:
    wrap = content_format == "openai"
    items: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            items.append({"type": "text", "text": part} if wrap else part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidPrompt("content parts must be strings or objects", param="messages")
        kind = part.get("type")
        if kind is None or part.get("uuid") is not None:
            if any(k in part for k in _MEDIA_KEYS):
                raise RenderUnsupported("media content is rendered by the engine")
            if "tool_reference" not in part:
                raise InvalidPrompt("Missing 'type' field in multimodal part.", param="type")
            kind = "tool_reference"
        if not isinstance(kind, str):
            raise InvalidPrompt("Invalid 'type' field in multimodal part.", param="type")
        if kind in _TEXT_KEYS:
            text = part.get(_TEXT_KEYS[kind])
            if text is None and kind in _SKIP_IF_MISSING:
                continue
            if wrap:
                item = {"type": "text", "text": text}
                item.update({k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS})
                items.append(item)
            elif text:
                items.append(text)
        elif kind == "tool_reference":
            name = part.get("name")
            if wrap:
                items.append({"type": "tool_reference", "name": name})
            elif name:
                items.append(name)
        elif kind in _MEDIA_TYPES:
            raise RenderUnsupported(f"content part of type {kind!r} is rendered by the engine")
        else:
            raise InvalidPrompt(f"Unsupported chat content part type: {kind!r}.", param="type")
    if wrap:
        return items
    return "\n".join(items)


def _tool_call(raw: object) -> Any:
    if not isinstance(raw, Mapping):
        return copy.deepcopy(raw)
    call = {k: copy.deepcopy(raw[k]) for k in ("id", "function", "type") if k in raw}
    fn = call.get("function")
    if isinstance(fn, Mapping):
        ordered = {k: fn[k] for k in ("arguments", "name") if k in fn}
        ordered.update({k: v for k, v in fn.items() if k not in ordered})
        call["function"] = ordered
    call.update({k: copy.deepcopy(v) for k, v in raw.items() if k not in call})
    return call


def _normalise_tool_calls(message: Message) -> None:
    calls = message["tool_calls"]
    if not calls:
        del message["tool_calls"]
        return
    for item in calls:
        if not isinstance(item, dict):
            raise InvalidPrompt("assistant tool_calls entries must be objects.", param="tool_calls")
        fn = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidPrompt(
                "chat completions only support assistant tool_calls of type 'function'.",
                param="tool_calls",
            )
        args = fn.get("arguments")
        parsed: object = {}
        if args:
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = {}
            else:
                parsed = args
            if not isinstance(parsed, dict):
                parsed = {}
        fn["arguments"] = parsed


__all__ = ["Message", "build_conversation", "convert_developer_role"]
