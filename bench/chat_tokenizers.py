"""Chat rendering and tokenising for the prompt checker (``bench.check_prompts``): the
shared ``prompt`` renderer over a model directory, or a replica's ``/tokenize``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ChatTokenizer",
    "HttpChatTokenizer",
    "LocalChatTokenizer",
    "Message",
    "http_tokenizer",
    "local_tokenizer",
]

Message = Mapping[str, Any]


class ChatTokenizer(Protocol):
    """Chat rendering + tokenisation exactly as the engine does it."""

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens kept)."""
        ...


def _chat_body(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The chat request fields that decide a rendering, as vLLM's ``/tokenize`` takes them."""
    body: dict[str, Any] = {"messages": [dict(m) for m in messages],
                            "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        body["tools"] = [dict(t) for t in tools]
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    return body


class LocalChatTokenizer:
    """``ChatTokenizer`` over the shared ``prompt`` renderer: a model directory rendered
    and tokenised exactly as vLLM does (chat template, special-token rule)."""

    def __init__(self, directory: Path) -> None:
        from prompt.render import ModelRenderer
        from prompt.tokenizer import load_tokenizer_files

        self._files = load_tokenizer_files(directory)
        self._renderer = ModelRenderer(self._files)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        body = _chat_body(messages, tools, add_generation_prompt, chat_template_kwargs)
        return list(self._renderer.tokenize_chat(body).token_ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self._files.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._files.tokenizer.decode(list(ids), skip_special_tokens=False))


class HttpChatTokenizer:
    """``ChatTokenizer`` that asks a replica (vLLM or ``kvroute sim``): ``POST /tokenize``
    and ``POST /detokenize``.  Blocking calls with a timeout: for the command line only,
    never on an event loop."""

    def __init__(self, url: str, model: str | None, timeout_s: float = 30.0) -> None:
        self._url = url.rstrip("/")
        self._model = model
        self._timeout = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.request

        if self._model is not None:
            body = {"model": self._model, **body}
        req = urllib.request.Request(
            self._url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310
            out: dict[str, Any] = json.loads(resp.read())
        return out

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        body = _chat_body(messages, tools, add_generation_prompt, chat_template_kwargs)
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def encode_text(self, text: str) -> list[int]:
        out = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return [int(t) for t in out["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(ids)})["prompt"])


def local_tokenizer(directory: Path) -> ChatTokenizer:
    """The ``prompt`` renderer for a model directory."""
    return LocalChatTokenizer(directory)


def http_tokenizer(url: str, model: str | None) -> ChatTokenizer:
    """A replica's ``/tokenize`` as the renderer."""
    return HttpChatTokenizer(url, model)
