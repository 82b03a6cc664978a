"""The tiny tokenizer builder and offline tokenizer loading (directories, HF cache)."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prompt.registry import ModelSpec, RendererRegistry
from prompt.tokenizer import (
    TokenizerNotFound,
    load_tokenizer_files,
    read_chat_template,
    resolve_model_dir,
)
from replica.vllm.tiny_tokenizer import (
    CHATML_SPECIAL_TOKENS,
    LLAMA3_SPECIAL_TOKENS,
    build_tokenizer,
)


def _digest(d: Path) -> str:
    files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    return hashlib.sha256(b"".join((d / f).read_bytes() for f in files)).hexdigest()


@pytest.mark.parametrize("template", ["llama3", "chatml"])
def test_build_is_deterministic_fast_and_complete(tmp_path: Path, template: Any) -> None:
    start = time.perf_counter()
    first = build_tokenizer(tmp_path / "a", template=template)
    elapsed = time.perf_counter() - start
    second = build_tokenizer(tmp_path / "b", template=template)
    assert _digest(first) == _digest(second)
    assert elapsed < 6.0  # < 2 s on an idle core; generous for a loaded CI box
    files = load_tokenizer_files(first)
    assert files.tokenizer.get_vocab_size() == 2000
    specials = LLAMA3_SPECIAL_TOKENS if template == "llama3" else CHATML_SPECIAL_TOKENS
    added = {t.content: i for i, t in files.tokenizer.get_added_tokens_decoder().items()}
    assert set(specials) <= set(added)
    assert min(added.values()) >= 2000 - len(specials)  # specials take the top ids
    config = json.loads((first / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in config and config["model_max_length"] > 0


def test_bos_only_for_llama3_with_special_tokens(
    tiny_dirs: dict[str, Path], hf_tokenizer: Callable[[str], Any]
) -> None:
    llama = load_tokenizer_files(tiny_dirs["llama3"])
    bos = llama.tokenizer.token_to_id("<|begin_of_text|>")
    assert llama.tokenizer.encode("hi").ids[0] == bos
    assert bos not in llama.tokenizer.encode("hi", add_special_tokens=False).ids
    chatml = load_tokenizer_files(tiny_dirs["chatml"])
    assert (
        chatml.tokenizer.encode("hi").ids
        == chatml.tokenizer.encode("hi", add_special_tokens=False).ids
    )
    assert llama.special_tokens == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
    }
    assert "bos_token" not in chatml.special_tokens
    # transformers agrees on both.
    assert hf_tokenizer("llama3").bos_token == "<|begin_of_text|>"
    assert hf_tokenizer("chatml").bos_token is None


def test_custom_corpus_and_bad_arguments(tmp_path: Path) -> None:
    out = build_tokenizer(tmp_path, template="chatml", vocab_size=300, corpus=["ab ab ab"] * 10)
    assert load_tokenizer_files(out).tokenizer.get_vocab_size() <= 300
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path, template="mistral")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path, template="llama3", vocab_size=100)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_chat_template_files_take_priority(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["chatml"], tmp_path / "m")
    (d / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    extra = d / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("TOOLS {{ tools | length }}")
    files = load_tokenizer_files(d)
    assert files.chat_template() == "FILE {{ messages[0].content }}"
    assert files.chat_template(has_tools=True) == "TOOLS {{ tools | length }}"
    assert files.chat_template("tool_use") == "TOOLS {{ tools | length }}"
    assert files.chat_template("literal {{ x }}") == "literal {{ x }}"
    registry = RendererRegistry([ModelSpec(name="m", block_size=4, tokenizer=d)])
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hey"}]}
    target = registry.resolve("m")
    assert target.renderer is not None
    assert target.renderer.chat_text(body).text == "FILE hey"
    body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    assert target.renderer.chat_text(body).text == "TOOLS 1"


def test_named_templates_in_tokenizer_config(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["chatml"], tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]
    cfg["bos_token"] = {"content": "<|endoftext|>", "lstrip": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    files = load_tokenizer_files(d)
    assert files.chat_template(has_tools=True) == "T"
    assert files.chat_template("rag") == "R"
    assert files.special_tokens["bos_token"] == "<|endoftext|>"
    with pytest.raises(LookupError):
        files.chat_template()


def test_resolves_repository_ids_from_the_local_cache_only(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    _copy(tiny_dirs["llama3"], snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_dir("acme/tiny", cache_dir=cache) == snapshot
    registry = RendererRegistry(
        [ModelSpec(name="acme/tiny", block_size=4, tokenizer="acme/tiny")], hf_cache_dir=cache
    )
    assert registry.render_completion({"model": "acme/tiny", "prompt": "x"})[0].num_tokens >= 2
    with pytest.raises(TokenizerNotFound):
        resolve_model_dir("acme/absent", cache_dir=cache)
    with pytest.raises(TokenizerNotFound):
        resolve_model_dir(tmp_path / "nowhere/at/all")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerNotFound):
        resolve_model_dir(empty)


def test_read_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(path) == "{{ messages }}"
    assert read_chat_template("{{ literal }}") == "{{ literal }}"
    with pytest.raises(FileNotFoundError):
        read_chat_template(tmp_path / "missing.jinja")
    spec = ModelSpec(name="m", block_size=4, chat_template=str(path))
    assert spec.render_options().chat_template == "{{ messages }}"
    assert (
        ModelSpec(name="m", block_size=4, chat_template="rag").render_options().chat_template
        == "rag"
    )
