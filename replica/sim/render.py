"""Prompt rendering for the simulated replica: request bodies to token ids, as vLLM does.

``PromptRenderer`` is the port the server uses.  ``TokenizerRenderer`` is the adapter
over a Hugging Face tokenizer directory, built on the shared ``prompt.render``
``ModelRenderer`` (the same code the router uses, so the sim's prompt tokens are the
router's: chat templates, ``add_special_tokens`` defaults, tools, truncation), with its
segment cache keeping repeated conversation prefixes cheap to re-encode.

Errors: ``prompt.errors.InvalidPrompt`` (and ``RenderUnsupported``) become
``RenderError`` carrying the OpenAI ``param``; the server answers 400.  A completions
body with several prompts is refused (the sim serves one prompt per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from prompt.errors import InvalidPrompt, RenderUnsupported
from prompt.render import ModelRenderer, RenderOptions
from prompt.tokenizer import load_tokenizer_files


class RenderError(ValueError):
    """The request cannot be rendered (bad messages, template error): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptRenderer(Protocol):
    """Turns request bodies into the token ids the engine hashes."""

    def render_chat(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a ``/v1/chat/completions`` (or chat ``/tokenize``) body."""
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


class TokenizerRenderer:
    """``PromptRenderer`` over a tokenizer directory (see the module docstring)."""

    def __init__(self, path: str | Path, options: RenderOptions | None = None) -> None:
        files = load_tokenizer_files(path)
        self._renderer = ModelRenderer(files, options)
        self._tok = files.tokenizer
        special_ids = {int(i) for i in self._tok.get_added_tokens_decoder()}
        self._pieces: dict[int, str] = {}
        # Generated tokens must decode on their own (no lone UTF-8 fragments), so that
        # streamed text deltas are clean; special tokens are never generated.
        self._vocab = [
            i for i in range(self._tok.get_vocab_size())
            if i not in special_ids and self.piece(i) and "\ufffd" not in self.piece(i)
        ]

    def render_chat(self, body: Mapping[str, Any]) -> list[int]:
        try:
            return list(self._renderer.tokenize_chat(body).token_ids)
        except InvalidPrompt as exc:
            raise RenderError(str(exc), exc.param) from exc
        except RenderUnsupported as exc:
            raise RenderError(str(exc)) from exc

    def render_completion(self, body: Mapping[str, Any]) -> list[int]:
        try:
            prompts = self._renderer.tokenize_completion(body)
        except InvalidPrompt as exc:
            raise RenderError(str(exc), exc.param) from exc
        except RenderUnsupported as exc:
            raise RenderError(str(exc)) from exc
        if len(prompts) != 1:
            raise RenderError("the simulated replica serves one prompt per request", "prompt")
        return list(prompts[0].token_ids)

    def decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=True)
        return text

    def token_str(self, token_id: int) -> str:
        s = self._tok.id_to_token(token_id)
        return s if s is not None else ""

    def piece(self, token_id: int) -> str:
        s = self._pieces.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=True)
            self._pieces[token_id] = s
        return s

    def sample_vocab(self) -> list[int]:
        return list(self._vocab)
