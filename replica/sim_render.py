"""Prompt rendering for the simulated replica: request bodies to token ids, as vLLM does.

``PromptRenderer`` is the port the server uses.  ``TokenizerRenderer`` is the adapter
over a Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``):

* chat: the directory's ``chat_template`` rendered with Jinja2 the way ``transformers``'
  ``apply_chat_template`` does (sandboxed, ``trim_blocks``/``lstrip_blocks``,
  ``raise_exception``, ``tojson``), with ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt`` (default true), ``continue_final_message``, the special
  tokens and ``chat_template_kwargs``; then encoded with ``add_special_tokens=False``
  (vLLM's default for chat; a request may set it);
* completion: a string is encoded with ``add_special_tokens=True`` by default (vLLM's
  default for completions); a list of ints is taken as token ids unchanged.

It does not do multimodal content, tool parsing or model-specific renderers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class RenderError(ValueError):
    """The request cannot be rendered (bad messages, template error)."""


class PromptRenderer(Protocol):
    """Turns request bodies into the token ids the engine hashes."""

    def render_chat(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a ``/v1/chat/completions`` body's prompt."""
        ...

    def render_completion(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a ``/v1/completions`` body's (single) prompt."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...

    def token_str(self, token_id: int) -> str:
        """The vocabulary string of one token (``/tokenize`` ``token_strs``)."""
        ...

    def piece(self, token_id: int) -> str:
        """Decoded text of one generated token."""
        ...

    def sample_vocab(self) -> list[int]:
        """Ids the simulated model may generate (no special tokens)."""
        ...


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TokenizerRenderer:
    """``PromptRenderer`` over a tokenizer directory (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg_file = tok_file.parent / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self._specials = {
            name: _token_text(cfg.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self._template = env.from_string(source) if isinstance(source, str) else None
        special_ids = {int(i) for i in self._tok.get_added_tokens_decoder()}
        self._pieces: dict[int, str] = {}
        # Generated tokens must decode on their own (no lone UTF-8 fragments), so that
        # streamed text deltas are clean; special tokens are never generated.
        self._vocab = [
            i for i in range(self._tok.get_vocab_size())
            if i not in special_ids and "\ufffd" not in self.piece(i) and self.piece(i)
        ]

    def render_chat(self, body: Mapping[str, Any]) -> list[int]:
        if self._template is None:
            raise RenderError("this tokenizer has no chat template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RenderError("'messages' must be a non-empty list")
        kwargs: dict[str, Any] = dict(self._specials)
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, Mapping):
            kwargs.update(extra)
        try:
            text = self._template.render(
                messages=messages,
                tools=body.get("tools"),
                documents=body.get("documents"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RenderError(str(exc)) from exc
        add_special = bool(body.get("add_special_tokens", False))
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special).ids
        return ids

    def render_completion(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            add_special = bool(body.get("add_special_tokens", True))
            ids: list[int] = self._tok.encode(prompt, add_special_tokens=add_special).ids
            return ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        raise RenderError("'prompt' must be a string or a list of token ids")

    def decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=True)
        return text

    def token_str(self, token_id: int) -> str:
        s = self._tok.id_to_token(token_id)
        return s if s is not None else ""

    def piece(self, token_id: int) -> str:
        """Decoded text of one token (cached; used for generated text)."""
        s = self._pieces.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=True)
            self._pieces[token_id] = s
        return s

    def sample_vocab(self) -> list[int]:
        return list(self._vocab)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None
