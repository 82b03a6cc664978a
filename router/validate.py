"""The body fields the router reads, validated as vLLM's request models validate them.

vLLM parses ``/v1/chat/completions`` and ``/v1/completions`` bodies with pydantic models
in lax mode, so a field of the wrong type is a 400 there, and some strings count as the
type they spell (``"stream": "true"`` is ``True``; ``"stream": "yes please"`` is a 400).
The router reads a few of those fields itself (``stream`` decides how it relays the
answer, ``prompt`` is rendered and hashed), so it must read them as vLLM will, and
refuse what vLLM would refuse before any routing work:

* each field below, when present and not ``null``, is validated by pydantic with the
  type vLLM declares (the same lax coercions); the coerced value replaces the raw one in
  the parsed body the policies see (the bytes sent upstream are unchanged: the replica
  coerces them the same way);
* ``stream_options`` without ``stream: true`` is a 400 (vLLM's rule);
* completions prompt token ids must lie in ``[0, 2**32)``: vLLM refuses an id past its
  vocabulary ("Token id N is out of vocabulary"), and no vocabulary reaches ``2**32``;
  a negative id is refused too (it would index outside the embedding table);
* each chat message is an object with a string ``role`` (vLLM's message types all
  require it).

Everything else (sampling parameters, message content) is the replica's to judge.
Errors are ``BadRequest`` with ``param`` naming the field, answered as OpenAI-shaped
400s.  Cost: a type check per present field; pydantic (Rust) only for values whose
Python type is not already the declared one, and for token id lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from router.errors import BadRequest
from router.policy import Endpoint

__all__ = ["MAX_TOKEN_ID", "validate_fields"]

MAX_TOKEN_ID = 2**32 - 1
"""The largest token id any vocabulary can have (ids are u32 in vLLM's hashes and ours)."""

_Prompt = list[int] | list[list[int]] | str | list[str]
_StreamOptions = dict[str, bool | None]

# (field, adapter, the Python type that needs no pydantic call)
_Check = tuple[str, TypeAdapter[Any], type | tuple[type, ...]]


def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


_COMMON: tuple[_Check, ...] = (
    ("stream", _adapter(bool), bool),
    ("stream_options", _adapter(_StreamOptions), ()),
    ("user", _adapter(str), str),
    ("n", _adapter(int), int),
    ("max_tokens", _adapter(int), int),
    ("add_special_tokens", _adapter(bool), bool),
    ("truncate_prompt_tokens", _adapter(Annotated[int, Field(ge=-1)]), ()),
)
_CHAT: tuple[_Check, ...] = (
    ("add_generation_prompt", _adapter(bool), bool),
    ("continue_final_message", _adapter(bool), bool),
    ("max_completion_tokens", _adapter(int), int),
)
_COMPLETIONS: tuple[_Check, ...] = (
    ("echo", _adapter(bool), bool),
    ("prompt", _adapter(_Prompt), str),
)


def validate_fields(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Validate (and coerce in place) the fields of a chat or completions ``body``;
    raises ``BadRequest`` as vLLM would answer 400."""
    _check(body, _COMMON)
    if endpoint == "chat":
        _check(body, _CHAT)
        _messages(body["messages"])
    else:
        _check(body, _COMPLETIONS)
        _token_ids(body.get("prompt"))
    options = body.get("stream_options")
    if options is not None and body.get("stream") is not True:
        raise BadRequest("Stream options can only be defined when `stream=True`.",
                         code="invalid_stream_options", param="stream_options")


def _check(body: dict[str, Any], checks: tuple[_Check, ...]) -> None:
    for name, adapter, exact in checks:
        value = body.get(name)
        if value is None or (exact and type(value) in _types(exact)):
            continue
        try:
            body[name] = adapter.validate_python(value)
        except ValidationError as exc:
            raise BadRequest(f"'{name}': {_first_error(exc)}", code="invalid_type",
                             param=name) from None


def _types(exact: type | tuple[type, ...]) -> tuple[type, ...]:
    return exact if isinstance(exact, tuple) else (exact,)


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    return str(errors[0]["msg"]) if errors else "invalid value"


def _token_ids(prompt: object) -> None:
    if not isinstance(prompt, list) or not prompt:
        return
    first = prompt[0]
    lists: list[list[int]]
    if isinstance(first, int):
        lists = [prompt]
    elif isinstance(first, list):
        lists = prompt
    else:
        return
    for ids in lists:
        if not ids:
            continue
        low, high = min(ids), max(ids)
        if high > MAX_TOKEN_ID:
            raise _out_of_vocabulary(high)
        if low < 0:
            raise _out_of_vocabulary(low)


def _out_of_vocabulary(token: int) -> BadRequest:
    return BadRequest(f"Token id {token} is out of vocabulary", code="invalid_prompt",
                      param="prompt")


def _messages(messages: list[Any]) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'",
                             code="invalid_messages", param="messages")

