"""Cutting text at a tokenizer's added tokens, and whether that is exact.

``Splitter`` cuts a text around any of a set of tokens, leftmost-longest, as
``tokenizers`` matches its added vocabulary.  ``build_splitters`` reads a tokenizer's
specification and returns the splitters for the tokens matched on the raw text and
after normalisation, or the reason why encoding the pieces separately would differ from
encoding the whole text (``prompt.segments`` then encodes whole texts).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

_SAFE_PRE_TOKENIZERS = frozenset(
    {
        "Sequence",
        "Split",
        "ByteLevel",
        "Whitespace",
        "WhitespaceSplit",
        "Digits",
        "Punctuation",
        "BertPreTokenizer",
        "CharDelimiterSplit",
        "UnicodeScripts",
        "FixedLength",
    }
)



class Splitter:
    """Splits text around any of ``tokens``, leftmost-longest, like ``re.split`` with a
    capturing alternation: ``[text, token, text, ..., token, text]``.

    Special tokens nearly always share a first character (``<``), so the scan jumps
    between occurrences of the first characters with ``str.find`` (memchr speed) and
    tests the candidates there, longest first; with many distinct first characters it
    uses the regex.
    """

    _MAX_FIRST_CHARS = 4

    def __init__(self, tokens: list[str]) -> None:
        ordered = sorted(set(tokens), key=lambda t: (-len(t), t))
        self._by_first: dict[str, list[str]] = {}
        for tok in ordered:
            self._by_first.setdefault(tok[0], []).append(tok)
        self._regex = re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")")

    def split(self, text: str) -> list[str]:
        by_first = self._by_first
        if len(by_first) > self._MAX_FIRST_CHARS:
            return self._regex.split(text)
        find = text.find
        starts = text.startswith
        if len(by_first) == 1:
            return self._split_one(text, *next(iter(by_first.items())))
        nexts = {c: find(c) for c in by_first}
        out: list[str] = []
        start = 0
        while True:
            at = min((i for i in nexts.values() if i >= 0), default=-1)
            if at < 0:
                break
            end = at + 1
            for tok in by_first[text[at]]:
                if starts(tok, at):
                    out.append(text[start:at])
                    out.append(tok)
                    start = end = at + len(tok)
                    break
            for c, i in nexts.items():
                if 0 <= i < end:
                    nexts[c] = find(c, end)
        out.append(text[start:])
        return out

    @staticmethod
    def _split_one(text: str, first: str, candidates: list[str]) -> list[str]:
        find = text.find
        starts = text.startswith
        out: list[str] = []
        start = 0
        at = find(first)
        while at >= 0:
            for tok in candidates:
                if starts(tok, at):
                    out.append(text[start:at])
                    out.append(tok)
                    start = at + len(tok)
                    at = find(first, start)
                    break
            else:
                at = find(first, at + 1)
        out.append(text[start:])
        return out


def _alternation(tokens: list[str]) -> Splitter | None:
    return Splitter(tokens) if tokens else None


def build_splitters(
    tokenizer: Tokenizer, added: dict[int, Any]
) -> tuple[Splitter | None, Splitter | None, str | None]:
    """The splitters for added tokens matched on the raw text and after normalisation,
    or the reason why cutting the text at added tokens would not be exact."""
    spec = json.loads(tokenizer.to_str())
    has_normalizer = spec.get("normalizer") is not None
    raw: list[str] = []
    normed: list[str] = []
    for tok in added.values():
        if tok.lstrip or tok.rstrip or tok.single_word:
            return None, None, f"added token {tok.content!r} strips or matches whole words"
        if tok.normalized and has_normalizer:
            return None, None, f"added token {tok.content!r} is matched after normalisation"
        (normed if tok.normalized else raw).append(tok.content)
    reason = _pre_tokenizer_reason(spec.get("pre_tokenizer"))
    if reason is not None:
        return None, None, reason
    if not raw and not normed:
        return None, None, "no added tokens to split on"
    if not raw:
        raw, normed = normed, []
    return _alternation(raw), _alternation(normed), None


def _pre_tokenizer_reason(node: Any) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        for child in node.get("pretokenizers", []):
            reason = _pre_tokenizer_reason(child)
            if reason is not None:
                return reason
        return None
    if kind == "Metaspace":
        if node.get("prepend_scheme", "always") == "first":
            return "Metaspace pre-tokenizer prepends only at the start of the input"
        return None
    if kind not in _SAFE_PRE_TOKENIZERS:
        return f"pre-tokenizer {kind} is not known to act on each piece independently"
    return None


__all__ = ["Splitter", "build_splitters"]
