"""Fixtures for the index tests.

Tokenizer fixtures (rendering engineer): tiny tokenizers trained locally by
``replica.vllm.tiny_tokenizer.build_tokenizer``, built once per session in temporary
directories; no model hub.  Variants differ in template style and special tokens:

* ``llama3``: Llama-3-style template, BOS added by the post-processor;
* ``chatml``: ChatML-style template, NFC normaliser, no BOS;
* ``chatml_prefix``: ChatML with a byte-level pre-tokenizer that adds a prefix space;
* ``llama3_extra``: Llama-3 with extra special tokens, one of which overlaps the
  template's text (``<|start_header_id|>sys`` is matched leftmost-longest inside
  ``<|start_header_id|>system``).

``tiny_dirs`` maps variant -> directory; ``hf_tokenizer(variant)`` returns the
transformers tokenizer (the reference implementation), loaded once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replica.vllm.tiny_tokenizer import build_tokenizer, default_corpus

TOKENIZER_VARIANTS: dict[str, dict[str, Any]] = {
    "llama3": {"template": "llama3"},
    "chatml": {"template": "chatml"},
    "chatml_prefix": {"template": "chatml", "add_prefix_space": True},
    "llama3_extra": {
        "template": "llama3",
        "extra_special_tokens": ["<|start_header_id|>sys", "<tool_call>", "<|python_tag|>"],
    },
}


class _TinyDirs(dict[str, Path]):
    """Builds each variant on first use (a smaller corpus trains 4x faster)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self._root = root
        self._corpus = list(default_corpus(n_lines=1500))

    def __missing__(self, name: str) -> Path:
        path = build_tokenizer(
            self._root / name, vocab_size=1200, corpus=self._corpus, **TOKENIZER_VARIANTS[name]
        )
        self[name] = path
        return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _TinyDirs(tmp_path_factory.mktemp("tiny-tokenizers"))


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_dirs: dict[str, Path]) -> Callable[[str], Any]:
    from transformers import AutoTokenizer

    loaded: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in loaded:
            loaded[variant] = AutoTokenizer.from_pretrained(str(tiny_dirs[variant]))
        return loaded[variant]

    return get
