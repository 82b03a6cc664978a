"""Loading a served model's tokenizer and chat templates from local files, offline.

``load_tokenizer_files(source)`` reads a Hugging Face tokenizer directory, or the snapshot
of a repository in the local Hugging Face cache, and returns :class:`TokenizerFiles`:
the ``tokenizers.Tokenizer`` (truncation and padding switched off: vLLM asks for
neither when it renders a prompt), the chat templates, the named special tokens that
``apply_chat_template`` hands to the template, and the tokenizer's truncation side.

Where things come from, as transformers 5.x loads them:

* ``tokenizer.json`` (required: only fast tokenizers are rendered locally);
* chat templates: ``chat_template.jinja`` (the default) and
  ``additional_chat_templates/<name>.jinja`` take priority over ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of ``{"name", "template"}``);
* special tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``,
  ``pad_token``, ``cls_token``, ``mask_token`` from ``tokenizer_config.json``, else from
  ``special_tokens_map.json`` (a string or an ``{"content": ...}`` object); unset ones
  are absent, so the template sees them as undefined.

Offline by construction: a repository id is looked up only in the local cache
(``huggingface_hub.try_to_load_from_cache``, which honours ``HF_HOME`` /
``HF_HUB_CACHE``); nothing here opens a network connection.  Loading does blocking file
I/O: call it at startup (or in a worker thread), never on the event loop's hot path.

Not handled: slow (SentencePiece-only) tokenizers, processor chat templates of
multimodal models (``chat_template.json``), remote code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer

SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens transformers passes to every chat template."""


class TokenizerNotFound(FileNotFoundError):
    """No local tokenizer for a model: not a directory with ``tokenizer.json`` and not
    in the local Hugging Face cache.  Callers fall back to asking a replica."""


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """Everything needed to render and tokenise for one model, loaded from disk."""

    directory: Path
    tokenizer: Tokenizer
    chat_templates: Mapping[str, str] = field(default_factory=dict)
    """Template sources by name; a single template is named ``"default"``."""
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    """Named special tokens (``bos_token`` ...) as strings; unset ones are absent."""
    truncation_side: Literal["left", "right"] = "right"
    """As configured; vLLM overrides it to ``"left"`` for generative models, so
    rendering uses ``RenderOptions.truncation_side`` instead."""

    def chat_template(self, requested: str | None = None, *, has_tools: bool = False) -> str:
        """The template source ``apply_chat_template`` would use.

        ``requested`` is a template name or a literal template (vLLM's
        ``--chat-template``, or a trusted request's ``chat_template``).  Without it, a
        model with several templates uses ``tool_use`` when tools are passed and
        ``default`` otherwise.  Raises ``LookupError`` when there is none.
        """
        templates = self.chat_templates
        if requested is not None:
            return templates.get(requested, requested)
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise LookupError(
            f"tokenizer in {self.directory} has no default chat template "
            f"(templates: {sorted(templates)})"
        )


def resolve_model_dir(
    source: str | Path, *, cache_dir: str | Path | None = None, revision: str | None = None
) -> Path:
    """The local directory holding ``source``'s tokenizer.

    ``source`` is a directory, or a Hugging Face repository id found in the local cache
    (``cache_dir``, default: the hub cache ``huggingface_hub`` resolves from the
    environment).  Raises :class:`TokenizerNotFound` otherwise.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerNotFound(f"{path} has no tokenizer.json")
        return path
    repo_id = str(source)
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/", "~")):
        raise TokenizerNotFound(f"{source} is neither a directory nor a repository id")
    from huggingface_hub import try_to_load_from_cache  # lazy: startup only

    found = try_to_load_from_cache(
        repo_id,
        "tokenizer.json",
        cache_dir=None if cache_dir is None else str(cache_dir),
        revision=revision,
    )
    if not isinstance(found, str):
        raise TokenizerNotFound(f"{repo_id} is not in the local Hugging Face cache")
    return Path(found).parent


def load_tokenizer_files(
    source: str | Path, *, cache_dir: str | Path | None = None, revision: str | None = None
) -> TokenizerFiles:
    """Load the tokenizer, templates and special tokens of ``source`` (see module doc)."""
    directory = resolve_model_dir(source, cache_dir=cache_dir, revision=revision)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    specials: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = _token_content(config.get(name))
        if value is None and name not in config:
            value = _token_content(special_map.get(name))
        if value is not None:
            specials[name] = value
    side = config.get("truncation_side", "right")
    return TokenizerFiles(
        directory=directory,
        tokenizer=tokenizer,
        chat_templates=_chat_templates(directory, config),
        special_tokens=specials,
        truncation_side="left" if side == "left" else "right",
    )


def read_chat_template(value: str | Path) -> str:
    """A template given on the command line: a file's contents, or the literal itself
    (vLLM's ``--chat-template`` accepts both)."""
    text = str(value)
    if "{" not in text and "\n" not in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"chat template file {path} not found")
        return path.read_text(encoding="utf-8")
    return text


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                templates[str(item.get("name"))] = item["template"]
    return templates


def _token_content(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


__all__ = [
    "SPECIAL_TOKEN_NAMES",
    "TokenizerFiles",
    "TokenizerNotFound",
    "load_tokenizer_files",
    "read_chat_template",
    "resolve_model_dir",
]
