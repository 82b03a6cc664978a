"""Shared fixtures for the bench tests: a tiny tokenizer directory (built once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok-llama3"), template="llama3")


class JinjaChatTokenizer:
    """Renders with the directory's chat template and tokenises with its tokenizer.json.

    A stand-in for the shared ``index`` renderer in tests of the checker's logic."""

    def __init__(self, directory: Path) -> None:
        import json

        import jinja2.sandbox
        from tokenizers import Tokenizer

        cfg = json.loads((directory / "tokenizer_config.json").read_text())
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg: str) -> None:
            raise ValueError(msg)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(cfg["chat_template"])
        self._bos = cfg.get("bos_token") or ""
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))

    def render(self, messages, *, tools=None, add_generation_prompt=True,  # type: ignore[no-untyped-def]
               chat_template_kwargs=None) -> list[int]:
        text = self._template.render(
            messages=list(messages), tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=self._bos,
            **(chat_template_kwargs or {}),
        )
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:  # type: ignore[no-untyped-def]
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


@pytest.fixture(scope="session")
def chat_tokenizer(llama3_dir: Path) -> JinjaChatTokenizer:
    return JinjaChatTokenizer(llama3_dir)
