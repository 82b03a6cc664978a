"""Asking a replica for a prompt's token ids when the router cannot render it itself.

Used when a model has no local tokenizer, or a request needs the engine's own processing
(images, model-specific renderers).  In vLLM's recommended order:

1. ``POST /v1/chat/completions/render`` / ``POST /v1/completions/render`` (vLLM 0.16+,
   behind ``--enable-scale-out`` since 0.30; enable with ``use_render_endpoint=True``):
   the request body as is; the answer is the exact ``GenerateRequest`` (``token_ids``)
   the engine would run;
2. ``POST /tokenize``: a ``TokenizeChatRequest`` with the same ``messages``, ``tools``,
   ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens`` and
   ``chat_template_kwargs``.  ``/tokenize`` has no ``documents`` or ``reasoning_effort``
   fields, so they are folded into ``chat_template_kwargs``, which reach the template the
   same way (``documents`` is a named ``apply_chat_template`` argument; ``reasoning_effort``
   and the derived ``enable_thinking`` are template variables).  Completions send one
   ``TokenizeCompletionRequest`` per string prompt; id lists need no replica.
   ``truncate_prompt_tokens`` is not a ``/tokenize`` field: it is applied to the answer
   here by slicing, on the left unless ``truncation_side`` is ``"right"`` (exact unless
   the tokenizer adds special tokens, which its own truncation would keep).

Every call has a timeout (``timeout_s``, the whole exchange).  Answers are cached by
the exact bytes of what was sent (bounded LRU), since a replica renders the same request
to the same ids.  Counters in :class:`RemoteRenderStats` (fallbacks, cache hits, errors,
timeouts) are plain ints for the router's metrics module to export.

The ``aiohttp.ClientSession`` is the caller's (the router's upstream session): this
module never creates or closes one.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import xxhash

from kvkeys.keys import block_keys
from prompt.errors import InvalidPrompt, RemoteRenderFailed, RemoteRenderTimeout
from prompt.keyer import KeyContext, Prompt

DEFAULT_TIMEOUT_S = 2.0
"""Rendering is milliseconds of CPU on the replica; two seconds means it is unwell."""
DEFAULT_CACHE_SIZE = 4096
"""Remembered answers (token id lists): retries and repeated prompts within a turn."""

_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
)


@dataclass(slots=True)
class RemoteRenderStats:
    """Counters of remote rendering (plain ints, read by the router's metrics)."""

    fallbacks: int = 0
    """Prompts rendered by a replica (cache hits included)."""
    cache_hits: int = 0
    requests: int = 0
    """HTTP requests sent."""
    errors: int = 0
    timeouts: int = 0


def tokenize_chat_payload(
    body: Mapping[str, Any], *, exclude_tools_when_tool_choice_none: bool = False
) -> dict[str, Any]:
    """The ``/tokenize`` body that renders exactly like the chat request ``body``."""
    payload: dict[str, Any] = {"model": body.get("model"), "messages": body.get("messages")}
    for name in _CHAT_FIELDS:
        if body.get(name) is not None:
            payload[name] = body[name]
    tools = body.get("tools")
    if tools is not None and not (
        exclude_tools_when_tool_choice_none and body.get("tool_choice") == "none"
    ):
        payload["tools"] = tools
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        user_set_thinking = "enable_thinking" in (body.get("chat_template_kwargs") or {})
        kwargs["reasoning_effort"] = effort
        if not user_set_thinking:
            kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        payload["chat_template_kwargs"] = kwargs
    return payload


class RemoteRenderer:
    """Token ids from a replica's ``/render`` or ``/tokenize`` endpoints, cached."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        use_render_endpoint: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._cache: OrderedDict[int, list[list[int]]] = OrderedDict()
        self.use_render_endpoint = use_render_endpoint
        self.stats = RemoteRenderStats()

    async def render_chat(
        self,
        replica_url: str,
        body: Mapping[str, Any],
        ctx: KeyContext,
        *,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> Prompt:
        """The prompt of chat ``body`` as rendered by the replica at ``replica_url``."""
        self.stats.fallbacks += 1
        if self.use_render_endpoint:
            (ids,) = await self._call(replica_url, "/v1/chat/completions/render", dict(body))
        else:
            payload = tokenize_chat_payload(
                body, exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none
            )
            (ids,) = await self._call(replica_url, "/tokenize", payload)
            ids = _truncate(ids, body)
        return _prompt(ids, ctx)

    async def render_completion(
        self, replica_url: str, body: Mapping[str, Any], ctx: KeyContext
    ) -> list[Prompt]:
        """The prompts of completions ``body`` as rendered by the replica."""
        self.stats.fallbacks += 1
        if self.use_render_endpoint:
            batches = await self._call(replica_url, "/v1/completions/render", dict(body))
            return [_prompt(ids, ctx) for ids in batches]
        prompt = body.get("prompt")
        items: Sequence[Any] = [prompt] if isinstance(prompt, str) else (prompt or [])
        if items and all(isinstance(t, int) for t in items):
            items = [items]
        add_special = body.get("add_special_tokens", True)
        out: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                payload = {
                    "model": body.get("model"),
                    "prompt": item,
                    "add_special_tokens": add_special is not False,
                }
                (ids,) = await self._call(replica_url, "/tokenize", payload)
            elif isinstance(item, list):
                ids = [int(t) for t in item]
            else:
                raise InvalidPrompt("unsupported prompt item", param="prompt")
            out.append(_prompt(_truncate(ids, body), ctx))
        if not out:
            raise InvalidPrompt("Either prompt or prompt_embeds must be provided.", param="prompt")
        return out

    async def tokenize(
        self, replica_url: str, payload: Mapping[str, Any], *, use_cache: bool = True
    ) -> list[int]:
        """``POST /tokenize`` with ``payload``; the parity checker bypasses the cache."""
        (ids,) = await self._call(replica_url, "/tokenize", dict(payload), use_cache=use_cache)
        return ids

    async def _call(
        self, base: str, path: str, payload: dict[str, Any], *, use_cache: bool = True
    ) -> list[list[int]]:
        raw = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        key = xxhash.xxh3_64_intdigest(path.encode() + b"\x00" + raw)
        cached = self._cache.get(key) if use_cache else None
        if cached is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return cached
        self.stats.requests += 1
        url = base.rstrip("/") + path
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.post(
                    url,
                    data=raw,
                    headers={"Content-Type": "application/json"},
                    timeout=self._timeout,
                ) as resp:
                    if resp.status != 200:
                        detail = (await resp.text())[:200]
                        self.stats.errors += 1
                        raise RemoteRenderFailed(f"{url} answered {resp.status}: {detail}")
                    answer = await resp.json(content_type=None)
        except TimeoutError as exc:
            self.stats.timeouts += 1
            raise RemoteRenderTimeout(f"{url} did not answer within {self._timeout_s}s") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            self.stats.errors += 1
            raise RemoteRenderFailed(f"{url} failed: {exc!r}") from exc
        result = _token_lists(answer, path)
        if result is None:
            self.stats.errors += 1
            raise RemoteRenderFailed(f"{url} answered without token ids")
        self._cache[key] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result


def _token_lists(answer: object, path: str) -> list[list[int]] | None:
    def ids_of(obj: object, field: str) -> list[int] | None:
        if not isinstance(obj, dict):
            return None
        ids = obj.get(field)
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return None
        return ids

    if path == "/tokenize":
        ids = ids_of(answer, "tokens")
        return None if ids is None else [ids]
    if path == "/v1/completions/render":
        if not isinstance(answer, list):
            return None
        lists = [ids_of(item, "token_ids") for item in answer]
        if any(x is None for x in lists):
            return None
        return [x for x in lists if x is not None]
    ids = ids_of(answer, "token_ids")
    return None if ids is None else [ids]


def _truncate(ids: list[int], body: Mapping[str, Any]) -> list[int]:
    limit = body.get("truncate_prompt_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0 or len(ids) <= limit:
        return ids
    if limit == 0:
        return []
    # vLLM truncates on the left unless the request says otherwise (generative models).
    return ids[:limit] if body.get("truncation_side") == "right" else ids[len(ids) - limit :]


def _prompt(ids: list[int], ctx: KeyContext) -> Prompt:
    return Prompt(
        token_ids=ids,
        block_keys=block_keys(
            ids,
            ctx.block_size,
            model=ctx.model,
            cache_salt=ctx.cache_salt,
            lora_name=ctx.lora_name,
        ),
        block_size=ctx.block_size,
        model=ctx.model,
        lora_name=ctx.lora_name,
        cache_salt=ctx.cache_salt,
        source="remote",
    )


__all__ = [
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_TIMEOUT_S",
    "RemoteRenderStats",
    "RemoteRenderer",
    "tokenize_chat_payload",
]
