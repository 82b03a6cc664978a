"""Cheap facts about a prompt before rendering it: how much text it holds, and whether
it can fit the model's context at all.

Tokenising is the router's most expensive step (a 6 MB prompt costs seconds), so a
prompt that cannot fit is refused from its text length alone, the way vLLM will refuse
it after tokenising (a 400).  The bound: a token covers at most ``B`` characters of text,
``B`` being the longest token in the tokenizer's vocabulary (added tokens included), so
a text of ``C`` characters has at least ``ceil(C / B)`` tokens.  It holds when the
tokenizer is a BPE (no unknown-token run fused into one token) and never *shortens*
text before splitting it: no normaliser other than
prepending or replacing single characters (Llama-3, Qwen, Mistral and GPT-2 style
tokenizers have none or only those) and no pre-tokeniser that drops characters
(``Whitespace``, BERT's): ``max_chars_per_token`` returns ``None`` for any other
tokenizer, and no prompt is refused early.

The text counted (``prompt_chars``) is what every template renders: the content of the
``user`` messages (templates may drop or rewrite system, assistant and tool messages,
e.g. earlier reasoning), or the completions prompt strings.  A request with
``truncate_prompt_tokens`` is never refused here (the engine cuts it to fit).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer

from router.errors import BadRequest
from router.policy import Endpoint

__all__ = ["max_chars_per_token", "prompt_chars", "too_long"]

_SAFE_NORMALIZERS = frozenset({"Prepend", "Replace", "Sequence"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits",
                                  "Punctuation", "Sequence", "UnicodeScripts"})


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of text one token can stand for, or ``None`` when the
    tokenizer may shorten text before splitting it (no bound then)."""
    config = json.loads(tokenizer.to_str())
    model = config.get("model") or {}
    # BPE only; an unknown-token run fused into one token could stand for any length.
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    if not _safe(config.get("normalizer"), _SAFE_NORMALIZERS, _replace_ok):
        return None
    if not _safe(config.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS, _split_ok):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=0)
    # Byte-level vocabularies spell each byte as one character, and no token stands
    # for more bytes than its spelling has characters; Metaspace's "▁" is one space.
    return max(longest, 1)


def _safe(node: Any, allowed: frozenset[str], check: Any) -> bool:
    if node is None:
        return True
    if not isinstance(node, Mapping) or node.get("type") not in allowed or not check(node):
        return False
    parts = node.get("normalizers") or node.get("pretokenizers") or []
    return all(_safe(part, allowed, check) for part in parts)


def _replace_ok(node: Mapping[str, Any]) -> bool:
    if node.get("type") != "Replace":
        return True
    pattern = node.get("pattern") or {}
    text = pattern.get("String") if isinstance(pattern, Mapping) else None
    content = node.get("content")
    # one character for at least one: text never gets shorter
    return isinstance(text, str) and len(text) == 1 and isinstance(content, str) and bool(content)


def _split_ok(node: Mapping[str, Any]) -> bool:
    return node.get("type") != "Split" or node.get("behavior") != "Removed"


def prompt_chars(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """Characters of text every rendering of ``body`` contains (see the module
    docstring); 0 when the body holds no such text."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return max(len(p) for p in prompt if isinstance(p, str))
        return 0
    total = 0
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    for message in messages:
        # ``type(...) is dict`` first: a request's parsed messages are dicts, and an ABC
        # check per message costs as much as the rest of the loop.
        if (type(message) is not dict and not isinstance(message, Mapping)
                or message.get("role") != "user"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total


def too_long(
    endpoint: Endpoint, body: Mapping[str, Any], chars: int, chars_per_token: int | None,
    max_model_len: int | None,
) -> BadRequest | None:
    """The 400 vLLM would give a prompt of ``chars`` characters that cannot fit in
    ``max_model_len`` tokens, or ``None`` when it may fit (or nothing is known)."""
    if chars_per_token is None or max_model_len is None or chars == 0:
        return None
    if body.get("truncate_prompt_tokens") is not None:
        return None
    at_least = -(-chars // chars_per_token)
    if at_least < max_model_len:
        return None
    return BadRequest(
        f"The decoder prompt (length at least {at_least}) is longer than the maximum model "
        f"length of {max_model_len}. Make sure that `max_model_len` is no smaller than the "
        "number of text tokens.",
        code="context_length_exceeded",
        param="messages" if endpoint == "chat" else "prompt",
    )
