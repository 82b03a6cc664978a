"""Shared fixtures for the bench tests: a tiny tokenizer directory (built once) and the
chat renderer over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.check_prompts import ChatTokenizer, LocalChatTokenizer
from replica.vllm.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok-llama3"), template="llama3")


@pytest.fixture(scope="session")
def chat_tokenizer(llama3_dir: Path) -> ChatTokenizer:
    """The shared ``index`` renderer over the tiny Llama-3-style tokenizer."""
    return LocalChatTokenizer(llama3_dir)
