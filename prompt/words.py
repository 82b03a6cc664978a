"""Word-level encoding of ASCII text: the pre-tokeniser's regex in Python, ids per word.

``tokenizers`` encodes a piece of text that holds no added token in three stages:
the normaliser, the pre-tokeniser (which cuts the text into words), and the model,
which encodes every word on its own.  Byte-level BPE tokenizers of the Llama 3 and
Qwen 2 families pre-tokenise with one regex split (``Split``, ``behavior="Isolated"``)
followed by ``ByteLevel`` with ``use_regex=false``, which maps bytes to characters and
cuts nothing.  So the ids of a piece are the ids of its words, each encoded alone,
concatenated.  Most words of a conversation's new message were seen before (in this
conversation or another), and ``WordEncoder`` keeps each word's ids: a new message
costs a regex scan and a dictionary lookup per word, and only the words never seen
go through the tokenizer's model (``Model.tokenize`` on the word's byte-level
characters, as the pipeline hands it over).  A word the model's own BPE cache knows
costs 0.8 us that way, where encoding each word as a text of its own costs 2.5 us and
the whole message 0.7 us a word; a word new to it costs the merges either way (2,000
novel words: 5.4 ms word by word, 6.9 ms as one text).

Exactness rests on three facts, each checked:

* the words are the tokenizer's words.  The regex runs in Python's ``re`` only on
  ASCII text (``str.isascii``, no scan), where its meaning does not depend on the
  engine: ``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]``, and with ``re.ASCII``
  ``\\s`` is ``[ \\t\\n\\v\\f\\r]``, the Unicode ``White_Space`` characters within
  ASCII, as in the tokenizer's Oniguruma.  :func:`ascii_pattern` translates only
  patterns made of literals, classes, quantifiers (no possessive ones), ``(?:``,
  ``(?i:``, lookaheads and the escapes ``\\r \\n \\t \\f \\v \\s \\S \\d \\D \\w \\W``,
  ``\\p{L}``, ``\\p{N}``; anything else disables the encoder.  Construction then
  compares the Python words with the tokenizer's own pre-tokeniser (their offsets) and
  the ids with ``Tokenizer.encode`` on probe strings covering every ASCII character;
  one difference disables the encoder.  Non-ASCII text is left to the tokenizer.
* a word encoded alone is the word encoded in its text: the regex must cut the word,
  alone, into itself (checked for each new word before its ids are kept); otherwise
  the piece is left to the tokenizer.
* the other stages act on each word alone: the normaliser is absent or a Unicode
  normal form (which leaves ASCII unchanged), ``ByteLevel`` adds no prefix space and
  maps each byte to the character the library's own ``ByteLevel`` gives it, and the
  model has no dropout.

Isolated splitting also keeps text between matches as words; the encoder requires the
matches to cover the text and otherwise leaves it to the tokenizer.

The word cache is bounded (``max_words``, and as many times ``_CHARS_PER_WORD``
characters) and dropped whole when full (the next texts refill it); ids are lists of
the caller's shared int objects.  Not thread-safe.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

DEFAULT_MAX_WORDS = 200_000
"""Distinct words kept, and ``_CHARS_PER_WORD`` characters per word on average (one
long "word", a run of letters without a space, counts its length): a word costs some
175 bytes (its text, its ids, the slot) and each character past the average at most
nine (one byte of text, an 8-byte id slot), so about 35 MB per model at most (measured
under a stream of distinct prompts: 36 MB); a chat workload's vocabulary (words with
and without their leading space, capitalised or not) is a few tens of thousands of
words."""
_CHARS_PER_WORD = 8

_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_ESCAPES = frozenset("rntfvsSdDwW")
_GROUPS = ("(?:", "(?i:", "(?!", "(?=")
_PROBE_COUNT = 600
_PROBE_SEED = 20240611


def ascii_pattern(pattern: str) -> str | None:
    """``pattern`` (Oniguruma syntax) for Python's ``re`` with ``re.ASCII``, meaning
    the same on ASCII text; ``None`` if it uses anything else (module doc)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if not (c.isascii() and c.isprintable()):
            return None
        if c == "\\":
            if pattern.startswith(("p{L}", "p{N}"), i + 1):
                chars = "A-Za-z" if pattern[i + 3] == "L" else "0-9"
                out.append(chars if in_class else f"[{chars}]")
                i += 5
                continue
            escaped = pattern[i + 1 : i + 2]
            if not escaped or not (
                escaped in _ESCAPES
                or (escaped.isascii() and escaped.isprintable() and not escaped.isalnum())
            ):
                return None
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if c == "[" or pattern.startswith("&&", i):
                return None  # a nested or POSIX class, an intersection
            in_class = c != "]"
            out.append(c)
            i += 1
            continue
        if c == "[":
            head = "[^" if pattern.startswith("[^", i) else "["
            if pattern.startswith("]", i + len(head)):
                return None
            out.append(head)
            i += len(head)
            in_class = True
            continue
        if c == "(" and not pattern.startswith(_GROUPS, i):
            return None  # a capturing group, lookbehind, atomic group, inline flags...
        if c in ".^$":
            return None
        if c == "+" and out and out[-1][-1:] in ("+", "*", "?", "}"):
            return None  # possessive quantifier
        out.append(c)
        i += 1
    if in_class:
        return None
    return "".join(out)


class WordEncoder:
    """Encodes ASCII text word by word, as the tokenizer would (module doc)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pattern: re.Pattern[str],
        ints: Sequence[int],
        *,
        max_words: int = DEFAULT_MAX_WORDS,
    ) -> None:
        self._tok = tokenizer
        self._findall = pattern.findall
        self._match = pattern.match
        self._tokenize = tokenizer.model.tokenize
        self._byte_chars = _byte_level_chars()
        self._ints = ints
        self._max_words = max_words
        self._words: dict[str, list[int]] = {}
        self._chars = 0
        """Characters of the cached words (bounded by ``max_words * _CHARS_PER_WORD``)."""
        self.words_encoded = 0
        """Words the tokenizer encoded (cache misses), for metrics and tests."""

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Tokenizer, ints: Sequence[int], *, max_words: int = DEFAULT_MAX_WORDS
    ) -> tuple[WordEncoder | None, str | None]:
        """An encoder for ``tokenizer`` and ``None``, or ``None`` and the reason there
        is none.  ``ints`` maps each id to the int object the ids should hold."""
        spec = json.loads(tokenizer.to_str())
        pattern, reason = _pre_tokenizer_pattern(spec)
        if pattern is None:
            return None, reason
        model = spec.get("model") or {}
        if model.get("dropout") not in (None, 0, 0.0):
            return None, "the model has dropout"
        translated = ascii_pattern(pattern)
        if translated is None:
            return None, "the pre-tokenizer's regex uses constructs not translated to re"
        try:
            compiled = re.compile(translated, re.ASCII)
        except re.error as exc:
            return None, f"the translated regex does not compile: {exc}"
        assert not compiled.groups  # ascii_pattern refuses capturing groups
        encoder = cls(tokenizer, compiled, ints, max_words=max_words)
        reason = encoder._self_check()
        encoder.clear()
        if reason is not None:
            return None, reason
        return encoder, None

    def encode(self, text: str) -> list[int] | None:
        """The ids of ``text`` (which holds no added token), or ``None`` when it is
        not ASCII or its words cannot be taken apart exactly: encode it whole then."""
        if not text.isascii():
            return None
        words = self._findall(text)
        if sum(map(len, words)) != len(text):
            return None  # text between matches: an Isolated split keeps it too
        known = self._words
        try:
            found = list(map(known.__getitem__, words))
        except KeyError:
            missing = set(words).difference(known)
            chars = sum(map(len, missing))
            if (len(known) + len(missing) > self._max_words
                    or self._chars + chars > self._max_words * _CHARS_PER_WORD):
                known.clear()  # generational: this text's words are learnt again
                missing = set(words)
                self._chars = 0
            if not self._learn(missing):
                return None
            found = list(map(known.__getitem__, words))
        return list(chain.from_iterable(found))

    def __len__(self) -> int:
        return len(self._words)

    def clear(self) -> None:
        """Forget every word."""
        self._words.clear()
        self._chars = 0

    def _learn(self, words: set[str]) -> bool:
        """Encode ``words`` alone and keep their ids; ``False`` (nothing kept) if one
        of them is not a word on its own (the regex cuts it further when alone)."""
        match = self._match
        for word in words:
            m = match(word)
            if m is None or m.end() != len(word):
                return False
        ints, size = self._ints, len(self._ints)
        tokenize, table, known = self._tokenize, self._byte_chars, self._words
        for word in words:
            known[word] = [
                ints[t.id] if t.id < size else t.id for t in tokenize(word.translate(table))
            ]
        self._chars += sum(map(len, words))
        self.words_encoded += len(words)
        return True

    def _self_check(self) -> str | None:
        """Compare with the tokenizer on probe strings (every ASCII character, the
        regex's contractions, runs of spaces, newlines, digits and punctuation)."""
        for probe in _probes():
            spans = [span for _, span in self._tok.pre_tokenizer.pre_tokenize_str(probe)]
            ours: list[tuple[int, int]] = []
            at = 0
            for word in self._findall(probe):
                ours.append((at, at + len(word)))
                at += len(word)
            if at != len(probe) or ours != spans:
                return f"the regex splits {probe!r} unlike the tokenizer"
            expected = self._tok.encode(probe, add_special_tokens=False).ids
            if self.encode(probe) not in (None, expected):
                return f"word-level ids of {probe!r} differ from the tokenizer's"
        return None


def _byte_level_chars() -> dict[int, str]:
    """ASCII code -> the character ``ByteLevel`` maps that byte to (asked of the
    library itself), for ``str.translate``."""
    byte_level = ByteLevel(add_prefix_space=False, use_regex=False)
    return {c: byte_level.pre_tokenize_str(chr(c))[0][0] for c in range(128)}


def _pre_tokenizer_pattern(spec: dict[str, Any]) -> tuple[str | None, str | None]:
    """The split regex of a ``[Split(Isolated), ByteLevel(use_regex=false)]`` pipeline."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and not _is_normal_form(normalizer):
        return None, "the normalizer may change ASCII text"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or [type(s) for s in steps] != [dict, dict]:
        return None, "the pre-tokenizer is not a regex split followed by ByteLevel"
    split: dict[str, Any] = steps[0]
    byte_level: dict[str, Any] = steps[1]
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance((split.get("pattern") or {}).get("Regex"), str)
    ):
        return None, "the pre-tokenizer's split is not an isolating regex split"
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None, "the pre-tokenizer's ByteLevel splits or adds a prefix space"
    return str(split["pattern"]["Regex"]), None


def _is_normal_form(node: dict[str, Any]) -> bool:
    if node.get("type") == "Sequence":
        return all(_is_normal_form(n) for n in node.get("normalizers", []))
    return node.get("type") in _NORMAL_FORMS


def _probes() -> list[str]:
    """Deterministic probe strings over all of ASCII, weighted towards what the
    pre-tokenisers' regexes distinguish."""
    every = [chr(c) for c in range(128)]
    pieces = [
        *every,
        "'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "'x",
        "  ", "   ", "\n", "\n\n", "\r\n", " \n", "\t", "\v", "\f",
        "a", "Word", "xyz", "1", "12", "123", "1234567",
        "!!", "...", "?!\n", "--", "a1", "_",
    ]
    rng = random.Random(_PROBE_SEED)
    probes = [f"a{c}b {c}{c} 1{c}2\n{c}\n " for c in every]
    for _ in range(_PROBE_COUNT):
        probes.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    return probes


__all__ = ["DEFAULT_MAX_WORDS", "WordEncoder", "ascii_pattern"]
