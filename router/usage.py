"""Reading ``usage`` out of responses cheaply, and hiding the usage chunk the router asked for.

vLLM reports ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``
(the ground truth for KV-hit predictions), and ``usage.completion_tokens`` (with the
prompt, the KV blocks the request held until it finished).  Streams carry it only when
``stream_options.include_usage`` is set, as a final chunk with ``"choices": []``.

* ``inject_include_usage(raw, body)`` turns usage on for the upstream request, changing
  the body as little as possible (a splice after ``{`` when the client sent no
  ``stream_options``, else a re-serialisation of that one object).
* ``UsageTap`` watches a stream.  Only events containing ``b'"usage"'`` are parsed.  With
  ``strip=True`` it frames the stream into whole SSE events (a partial event is held back
  only until its blank line arrives: nothing is delayed beyond the event it belongs to)
  and drops the usage-only chunk, so the client sees exactly what it asked for.  With
  ``strip=False`` chunks pass through untouched.
* ``usage_of_body(body)`` reads a non-streaming JSON response.  It decodes only the
  ``usage`` member (msgspec, every other member skipped unbuilt: the answer text is most
  of the body), so its cost hardly grows with the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import orjson

__all__ = ["UsageNumbers", "UsageTap", "inject_include_usage", "usage_of_body"]

_USAGE = b'"usage"'
# A stream that sends no event boundary within this many bytes is passed on raw rather
# than held: framing must never turn into buffering.
_MAX_HELD = 1 << 16


def inject_include_usage(raw: bytes, body: Mapping[str, Any]) -> bytes:
    """``raw`` with ``stream_options.include_usage = true``."""
    options = body.get("stream_options")
    if options is None and "stream_options" not in body:
        start = raw.index(b"{") + 1
        return raw[:start] + b'"stream_options":{"include_usage":true},' + raw[start:]
    patched = dict(body)
    patched["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                 "include_usage": True}
    return orjson.dumps(patched)


UsageNumbers = tuple[int | None, int | None, int | None]
"""``(prompt_tokens, cached_tokens, completion_tokens)``, each ``None`` when absent."""

_NO_USAGE: UsageNumbers = (None, None, None)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _usage_numbers(obj: Any) -> UsageNumbers | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (_int_or_none(usage.get("prompt_tokens")), _int_or_none(cached),
            _int_or_none(usage.get("completion_tokens")))


class _WithUsage(msgspec.Struct):
    """A response object as far as usage goes: any other member is skipped."""

    usage: Any = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def usage_of_body(body: bytes) -> UsageNumbers:
    """``(prompt_tokens, cached_tokens, completion_tokens)`` of a JSON response (``None``
    where absent)."""
    if _USAGE not in body:
        return _NO_USAGE
    try:
        usage = _decode_usage(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):  # not JSON, or not an object
        return _NO_USAGE
    found = _usage_numbers({"usage": usage})
    return found if found is not None else _NO_USAGE


class UsageTap:
    """Extracts usage from an SSE stream; optionally strips the usage-only chunk."""

    __slots__ = ("strip", "prompt_tokens", "cached_tokens", "completion_tokens", "_held")

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client now for ``chunk`` (possibly ``b""``)."""
        if not self.strip:
            if _USAGE in chunk:
                for event in chunk.split(b"\n\n"):
                    self._inspect(event)
            return chunk
        data = self._held + chunk if self._held else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > _MAX_HELD:
                self._held = b""
                return data
            self._held = data
            return b""
        end += 2
        ready, self._held = (data, b"") if end == len(data) else (data[:end], data[end:])
        if _USAGE not in ready:
            return ready
        kept = [e + b"\n\n" for e in ready[:-2].split(b"\n\n") if self._inspect(e)]
        return b"".join(kept)

    def flush(self) -> bytes:
        """Whatever is held at the end of the stream (an unterminated last event)."""
        held, self._held = self._held, b""
        return held

    def _inspect(self, event: bytes) -> bool:
        """Record usage found in ``event``; return whether to keep the event."""
        if _USAGE not in event:
            return True
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                obj = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            found = _usage_numbers(obj)
            if found is None:
                continue
            self.prompt_tokens, self.cached_tokens, self.completion_tokens = found
            if self.strip and obj.get("choices") == []:
                return False
        return True
