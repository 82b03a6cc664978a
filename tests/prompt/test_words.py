"""Word-level encoding (``prompt.words``) equals the tokenizer, or declines.

Over random text (all of ASCII, control characters included, and some non-ASCII) the
word encoder's ids equal ``tokenizers``' on the whole text, or it returns ``None``
(non-ASCII text, words the regex cuts differently alone).  Known words never reach the
tokenizer again; the word cache is bounded.  ``ascii_pattern`` translates the Llama 3
and Qwen 2 regexes and refuses every construct whose meaning could differ between
Oniguruma and Python's ``re``; tokenizers of another shape get no word encoder.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prompt.segments import SegmentEncoder
from prompt.tokenizer import load_tokenizer_files
from prompt.words import WordEncoder, ascii_pattern
from tests.prompt.tokenizer_text import SPECIALS, VARIANTS

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

ascii_text = st.text(alphabet=st.characters(max_codepoint=127), max_size=60)
any_text = st.one_of(
    ascii_text,
    st.text(alphabet=string.printable + "éè日本🙂\u0301\u00a0", max_size=40),
    st.lists(
        st.sampled_from(["'s", "'LL", " ", "  ", "\n\n", "\r\n", "123456", "word", "!?", "\t"]),
        max_size=12,
    ).map("".join),
)


@pytest.fixture(scope="module")
def encoders(tiny_dirs: dict[str, Path]) -> dict[str, SegmentEncoder]:
    return {v: SegmentEncoder(load_tokenizer_files(tiny_dirs[v]).tokenizer) for v in VARIANTS}


def test_known_regexes_translate() -> None:
    assert ascii_pattern(LLAMA3) == (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
        r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    assert ascii_pattern(QWEN2) is not None


@pytest.mark.parametrize(
    "pattern",
    [
        r"\p{Lu}+",  # other properties
        r"\P{L}",
        r"(\w+)",  # capturing group
        r"(?<=a)b",  # lookbehind
        r"(?>a+)",  # atomic group
        r"(?i)a",  # global inline flags
        r"a.b",
        r"^a",
        r"a$",
        r"a++",  # possessive
        r"[[:alpha:]]",
        r"[a-z&&[^b]]",
        r"[a-c&&b]",  # Oniguruma's intersection, three literals to Python
        r"\x41",
        r"\u0041",
        r"\X",
        r"\h",
        r"\1",
        r"[]a]",
        r"[a",
        "é",
        "a\\",  # a trailing backslash
    ],
)
def test_other_constructs_are_refused(pattern: str) -> None:
    assert ascii_pattern(pattern) is None


def test_which_tokenizers_get_a_word_encoder(encoders: dict[str, SegmentEncoder]) -> None:
    assert encoders["llama3"].words is not None
    assert encoders["chatml"].words is not None  # NFC leaves ASCII unchanged
    assert encoders["llama3_extra"].words is not None
    assert encoders["chatml_prefix"].words is None
    assert "prefix space" in (encoders["chatml_prefix"].words_reason or "")


@pytest.mark.parametrize("variant", ["llama3", "chatml", "llama3_extra"])
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=any_text, other=any_text)
def test_word_encoding_equals_the_tokenizer(
    variant: str, text: str, other: str, encoders: dict[str, SegmentEncoder]
) -> None:
    assume(not any(s in text + other for s in SPECIALS))
    enc = encoders[variant]
    words = enc.words
    assert words is not None
    for piece in (text, other, text + other, other + text):
        ids = words.encode(piece)
        if piece.isascii():
            assert ids is not None
        if ids is not None:
            assert ids == enc.encode_uncached(piece)


def test_known_words_skip_the_tokenizer(encoders: dict[str, SegmentEncoder]) -> None:
    words = encoders["llama3"].words
    assert words is not None
    words.encode("the cache and the router, 12345 times!\n\n")
    before = words.words_encoded
    assert words.encode("the router and the cache") is not None
    assert words.words_encoded == before
    assert words.encode("the unseen router") is not None
    assert words.words_encoded == before + 1
    assert words.encode("non-ASCII café") is None


def test_the_word_cache_is_bounded(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer_files(tiny_dirs["llama3"]).tokenizer
    words, _ = WordEncoder.for_tokenizer(tokenizer, list(range(5000)), max_words=20)
    assert words is not None
    for i in range(50):
        text = f"text number {i} with words w{i} x{i} y{i}"
        assert words.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert len(words) <= 20


def test_a_word_cut_differently_alone_is_left_to_the_tokenizer(
    tiny_dirs: dict[str, Path],
) -> None:
    """``ab`` is a word before ``c`` only: alone, the regex cuts it into ``a``, ``b``."""
    tokenizer = load_tokenizer_files(tiny_dirs["llama3"]).tokenizer
    words = WordEncoder(tokenizer, re.compile(r"ab(?=c)|a|b|c", re.ASCII), list(range(5000)))
    assert words.encode("abc") is None
    assert len(words) == 0
    assert words.encode("ba") == [
        *tokenizer.encode("b", add_special_tokens=False).ids,
        *tokenizer.encode("a", add_special_tokens=False).ids,
    ]


def test_text_between_matches_is_left_to_the_tokenizer(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer_files(tiny_dirs["llama3"]).tokenizer
    words = WordEncoder(tokenizer, re.compile(r"[a-z]+", re.ASCII), list(range(5000)))
    assert words.encode("abc def") is None  # the space is no match
    assert words.encode("abc") is not None


def test_warm_turn_pieces_are_encoded_word_by_word(encoders: dict[str, SegmentEncoder]) -> None:
    enc = encoders["llama3"]
    enc.clear()
    first = "<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>"
    enc.split(first)
    by_words = enc.stats.by_words
    second = first + "<|start_header_id|>assistant<|end_header_id|>\n\nhello again, there"
    split = enc.split(second, enc.split(first))
    assert split.ids == enc.encode_uncached(second)
    assert enc.stats.by_words > by_words


def _variant(tiny_dirs: dict[str, Path], change: Any) -> Tokenizer:
    """The tiny llama3 tokenizer with its JSON changed by ``change(spec)``."""
    spec = json.loads(load_tokenizer_files(tiny_dirs["llama3"]).tokenizer.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


_SPLIT = ["pre_tokenizer", "pretokenizers", 0]


def _set(path: list[Any], value: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_set(["normalizer"], {"type": "Lowercase"}), "normalizer"),
        (
            _set(["normalizer"], {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}),
            "normalizer",
        ),
        (_set(["pre_tokenizer"], {"type": "Whitespace"}), "regex split followed by ByteLevel"),
        (_set(["pre_tokenizer", "pretokenizers", 0, "behavior"], "Removed"), "isolating"),
        (_set(["pre_tokenizer", "pretokenizers", 0, "pattern"], {"String": " "}), "isolating"),
        (_set(["pre_tokenizer", "pretokenizers", 1, "use_regex"], True), "ByteLevel"),
        (_set(["model", "dropout"], 0.5), "dropout"),
        (_set([*_SPLIT, "pattern"], {"Regex": r"\p{Lu}+|."}), "constructs"),
        (_set([*_SPLIT, "pattern"], {"Regex": "a{2,1}"}), "compile"),
        # Empty matches: the tokenizer drops them, Python's findall keeps them.
        (_set([*_SPLIT, "pattern"], {"Regex": r"\p{L}*"}), "unlike the tokenizer"),
    ],
)
def test_tokenizers_of_another_shape_get_none(
    tiny_dirs: dict[str, Path], change: Any, reason: str
) -> None:
    words, why = WordEncoder.for_tokenizer(_variant(tiny_dirs, change), list(range(5000)))
    assert words is None
    assert why is not None and reason in why


def test_normal_forms_leave_ascii_alone(tiny_dirs: dict[str, Path]) -> None:
    nfkc = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFC"}]}
    words, why = WordEncoder.for_tokenizer(
        _variant(tiny_dirs, _set(["normalizer"], nfkc)), list(range(5000))
    )
    assert words is not None, why


def test_a_regex_that_disagrees_with_the_tokenizer_fails_the_self_check(
    tiny_dirs: dict[str, Path],
) -> None:
    tokenizer = load_tokenizer_files(tiny_dirs["llama3"]).tokenizer
    words = WordEncoder(tokenizer, re.compile(r"\S+|\s+", re.ASCII), list(range(5000)))
    assert "unlike the tokenizer" in (words._self_check() or "")


def test_word_ids_that_differ_from_the_tokenizer_fail_the_self_check(
    tiny_dirs: dict[str, Path],
) -> None:
    tokenizer = load_tokenizer_files(tiny_dirs["llama3"]).tokenizer
    words, _ = WordEncoder.for_tokenizer(tokenizer, list(range(5000)))
    assert words is not None and words._self_check() is None
    words._byte_chars = {**words._byte_chars, ord(" "): "x"}  # a wrong byte-level map
    words.clear()
    assert "differ from the tokenizer" in (words._self_check() or "")
