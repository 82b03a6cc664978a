"""Incremental tokenisation: cut rendered text at added tokens, cache each piece's ids.

A multi-turn conversation is re-sent whole on every turn, and all but the last message
render to the same text as before.  ``SegmentEncoder`` exploits how ``tokenizers``
encodes a string:

1. the added vocabulary (special and other added tokens) is matched first, leftmost
   longest, on the raw text (tokens with ``normalized=False``), then on the normalised
   remaining pieces (tokens with ``normalized=True``);
2. every remaining piece is normalised and pre-tokenised *on its own*, and the model
   never merges across pieces.

So the ids of a text are the concatenation of the ids of its pieces, each encoded
alone, with each added token mapped to its id.  The encoder splits the rendered text
the same way (a regex alternation, longest first, is leftmost-longest), looks each
piece up in a bounded LRU cache (text -> ids), and encodes only the pieces it has not
seen: on turn N+1 that is the new messages.  A new piece is encoded word by word when
``prompt.words`` can do it exactly (ASCII text of a tokenizer it understands), else by
the tokenizer.

When the equivalence cannot be guaranteed the encoder does not split (``splittable``
is false, ``unsplittable_reason`` says why) and caches whole texts instead:

* an added token with ``lstrip``/``rstrip``/``single_word`` (matching depends on the
  neighbouring text);
* an added token with ``normalized=True`` while the tokenizer has a normaliser;
* a pre-tokeniser that treats the start of the input specially: ``Metaspace`` with
  ``prepend_scheme="first"`` (the piece after a special token would get a prefix that
  it does not get inside the whole text), or any pre-tokeniser type not known to act on
  each piece independently;
* a self-check on probe strings around every added token disagrees.

``add_special_tokens=True`` adds the post-processor's tokens; the encoder learns them
as a fixed prefix and suffix from probes, and encodes whole texts if they are not
fixed (e.g. a pair template).

Each cached piece carries a serial number, unique for the life of the encoder, that
``prompt.keyer.PromptKeyer`` uses to memoise block keys per sequence of pieces.  Added
tokens use ``-(id + 1)`` as serial.

Turn N+1's text starts with most of turn N's, so ``split(text, previous)`` does not
even cut and look up the shared part again.  A ``TextSplit`` records where each added
token matched on the raw text ends.  The cut is leftmost-longest, so the decision at a
position depends only on the next ``L`` characters (``L`` = the longest added token):
if two texts agree on their first ``P`` characters, every cut ending at or before
``P - L + 1`` is made identically in both, and the rest of the text is cut as a text
of its own from there.  ``split`` finds ``P`` by comparing the texts (memcmp speed),
takes the previous segments up to the last such cut and cuts only the remainder.
Reused pieces are not refreshed in the LRU (they are not looked up).  The ids up to
that cut are the previous split's, shared without a copy (``prompt.token_ids``: a split is
a value, and nothing it can see ever changes).

The encoder is not thread-safe; it belongs to one event loop.
"""

from __future__ import annotations

import itertools
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from tokenizers import Tokenizer

from prompt.added_tokens import build_splitters
from prompt.token_ids import TokenIds
from prompt.words import DEFAULT_MAX_WORDS, WordEncoder

Segment = tuple[int, Sequence[int]]
"""``(serial, token ids)`` of one piece of a prompt."""

DEFAULT_MAX_CACHED_TOKENS = 2_000_000
"""Size of the piece cache, in token ids: a piece counts its ids, plus one per
``_CHARS_PER_ID`` characters of its text (a long piece of few tokens still counts its
text), plus ``_ENTRY_IDS`` for its entry.  Measured at about 26 bytes per counted id
(the id's slot, its share of the text and of the entry), so the default is about 52 MB
per model: a few hundred concurrent 10-turn conversations of 6k tokens, the working set
a router sees between turns."""
_CHARS_PER_ID = 4
_ENTRY_IDS = 8


def _cost(key: str, ids: Sequence[int]) -> int:
    """What a cached piece counts against ``max_cached_tokens``."""
    return len(ids) + len(key) // _CHARS_PER_ID + _ENTRY_IDS

@dataclass(slots=True)
class SegmentStats:
    """Counters of one encoder; plain ints for the router's metrics to read."""

    hits: int = 0
    misses: int = 0
    tokens_encoded: int = 0
    evictions: int = 0
    reused: int = 0
    """Segments taken over from a previous split (``SegmentEncoder.split``)."""
    by_words: int = 0
    """New pieces encoded word by word (``prompt.words``), of ``misses``."""


@dataclass(frozen=True, slots=True)
class TextSplit:
    """A text cut into segments, and the cuts a longer text sharing its start may keep.

    ``offsets[i]`` is where the ``i``-th added token matched on the raw text ends
    (ascending), ``counts[i]`` the number of segments and ``tokens[i]`` the number of
    token ids up to there.  ``ids`` are the segments' ids concatenated.  A value: treat
    every field as read-only.
    """

    text: str
    segments: list[Segment]
    ids: TokenIds
    offsets: array[int]
    counts: array[int]
    tokens: array[int]
    shared: int = 0
    """Leading segments taken over from the split this one resumed."""


class SegmentEncoder:
    """Encodes text as ``tokenizer.encode`` does, re-encoding only unseen pieces."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        max_cached_words: int = DEFAULT_MAX_WORDS,
    ) -> None:
        if max_cached_tokens < 0:
            raise ValueError("max_cached_tokens must be >= 0")
        self._tok = tokenizer
        self._max_tokens = max_cached_tokens
        self._cache: OrderedDict[str, Segment] = OrderedDict()
        self._cached_tokens = 0
        self._serials = itertools.count(1)
        self.stats = SegmentStats()
        added = tokenizer.get_added_tokens_decoder()
        # One int object per vocabulary id, shared by every cached piece: ids lists
        # then point into a small, hot set of objects (building a prompt's id list
        # touches each one) instead of one object per cached token.
        self._ints = list(range(max(tokenizer.get_vocab_size(with_added_tokens=True), 1)))
        self._added_ids: dict[str, int] = {
            tok.content: self._ints[i] if i < len(self._ints) else i for i, tok in added.items()
        }
        self._longest_added = max((len(t) for t in self._added_ids), default=0)
        self._raw_split, self._norm_split, reason = build_splitters(tokenizer, added)
        self.splittable = reason is None
        self.unsplittable_reason = reason
        self.words: WordEncoder | None = None
        self.words_reason: str | None = "the text is not split at added tokens"
        if self.splittable:
            self.words, self.words_reason = WordEncoder.for_tokenizer(
                tokenizer, self._ints, max_words=max_cached_words
            )
        if self.splittable and not self._self_check():
            self.splittable = False
            self.unsplittable_reason = "self-check failed: split encoding differs"
        self._affixes = self._learn_affixes()

    # -- public API ---------------------------------------------------------------------

    def segments(self, text: str, *, add_special_tokens: bool = False) -> list[Segment]:
        """The pieces of ``text`` with their ids; their concatenation is the encoding."""
        if add_special_tokens:
            if self._affixes is None:
                return [self._whole(text, add_special_tokens=True)]
            prefix, suffix = self._affixes
            return [*prefix, *self._pieces(text), *suffix]
        return self._pieces(text)

    def split(self, text: str, previous: TextSplit | None = None) -> TextSplit:
        """``segments(text)``, keeping the cuts it shares with ``previous`` (module doc)."""
        if not self.splittable or self._raw_split is None:
            pieces = self._pieces(text)
            ids = TokenIds.of(i for _, piece in pieces for i in piece)
            return TextSplit(text, pieces, ids, array("q"), array("q"), array("q"))
        start = shared = kept = 0
        segments: list[Segment] = []
        offsets: array[int] = array("q")
        counts: array[int] = array("q")
        tokens: array[int] = array("q")
        if previous is not None and previous.offsets:
            limit = _common_prefix_length(text, previous.text) - self._longest_added + 1
            kept = bisect_right(previous.offsets, limit)
            if kept:
                start, shared = previous.offsets[kept - 1], previous.counts[kept - 1]
                segments = previous.segments[:shared]
                offsets, counts = previous.offsets[:kept], previous.counts[:kept]
                tokens = previous.tokens[:kept]
                self.stats.reused += shared
        self._cut(text[start:] if start else text, segments, start, offsets, counts)
        # The ids of the segments cut just now, and the token counts at their cuts.
        keep = tokens[-1] if kept else 0
        new: list[int] = []
        cut = kept
        for n, (_, piece) in enumerate(segments[shared:], shared + 1):
            new.extend(piece)
            if cut < len(counts) and counts[cut] == n:
                tokens.append(keep + len(new))
                cut += 1
        assert len(tokens) == len(offsets)
        # The ids up to the last cut that every longer text starting with this one makes
        # too extend the conversation's stem (the next turn keeps them); the rest are this
        # text's own (``prompt.token_ids``).
        stable = bisect_right(offsets, len(text) - self._longest_added + 1)
        stem_end = max(tokens[stable - 1] if stable else 0, keep) - keep
        tail = new[stem_end:]
        del new[stem_end:]
        ids = (previous.ids.extend(keep, new, tail) if kept and previous is not None
               else TokenIds(new, len(new), tail))
        return TextSplit(text, segments, ids, offsets, counts, tokens, shared)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, equal to ``tokenizer.encode(text, ...).ids``."""
        out: list[int] = []
        for _, ids in self.segments(text, add_special_tokens=add_special_tokens):
            out.extend(ids)
        return out

    def encode_uncached(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The reference: the tokenizer on the whole text, no cache (tests, parity)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def cached_tokens(self) -> int:
        """Token ids currently held in the piece cache."""
        return self._cached_tokens

    def clear(self) -> None:
        """Drop every cached piece and word (serials are never reused)."""
        self._cache.clear()
        self._cached_tokens = 0
        if self.words is not None:
            self.words.clear()

    # -- internals ----------------------------------------------------------------------

    def _pieces(self, text: str) -> list[Segment]:
        if not self.splittable or self._raw_split is None:
            return [self._whole(text, add_special_tokens=False)] if text else []
        out: list[Segment] = []
        self._cut(text, out, 0, None, None)
        return out

    def _cut(
        self,
        text: str,
        out: list[Segment],
        at: int,
        offsets: array[int] | None,
        counts: array[int] | None,
    ) -> None:
        """Append ``text``'s segments to ``out``; with ``offsets``/``counts``, also the
        end of each added token matched on the raw text (``text`` starting at ``at``)."""
        assert self._raw_split is not None
        missing: dict[str, list[int]] = {}  # piece -> positions in ``out``
        added = self._added_ids
        cache = self._cache
        for i, piece in enumerate(self._raw_split.split(text)):
            at += len(piece)
            if i % 2:
                tid = added[piece]
                out.append((-tid - 1, (tid,)))
                if offsets is not None and counts is not None:
                    offsets.append(at)
                    counts.append(len(out))
            elif piece:
                subs = [piece] if self._norm_split is None else self._norm_split.split(piece)
                for j, sub in enumerate(subs):
                    if j % 2:
                        tid = added[sub]
                        out.append((-tid - 1, (tid,)))
                    elif sub:
                        seg = cache.get(sub)
                        if seg is None:
                            missing.setdefault(sub, []).append(len(out))
                            out.append((0, ()))
                        else:
                            cache.move_to_end(sub)
                            out.append(seg)
                            self.stats.hits += 1
        if missing:
            self._encode_missing(missing, out)

    def _encode_missing(self, missing: dict[str, list[int]], out: list[Segment]) -> None:
        """Encode the new pieces and put their segments at their positions in ``out``."""
        # New pieces go word by word where ``prompt.words`` can (ASCII text, most words
        # known: a regex scan and a lookup per word, a third of the tokenizer's time).
        # The rest are encoded in one call without character offsets (a quarter of the
        # encoder's work, and never used).  kvroute's processes set
        # TOKENIZERS_PARALLELISM=false, so the call stays on this thread instead of
        # waking the tokenizers thread pool for the one or two new pieces of a turn.
        pieces = list(missing)
        if self.words is not None:
            rest = []
            for piece in pieces:
                ids = self.words.encode(piece)
                if ids is None:
                    rest.append(piece)
                    continue
                self.stats.by_words += 1
                seg = self._store(piece, ids, shared=True)
                for pos in missing[piece]:
                    out[pos] = seg
            pieces = rest
        if pieces:
            encoded = self._tok.encode_batch_fast(pieces, add_special_tokens=False)
            for piece, enc in zip(pieces, encoded, strict=True):
                seg = self._store(piece, enc.ids)
                for pos in missing[piece]:
                    out[pos] = seg

    def _whole(self, text: str, *, add_special_tokens: bool) -> Segment:
        key = ("\x01" if add_special_tokens else "\x00") + text
        seg = self._cache.get(key)
        if seg is not None:
            self._cache.move_to_end(key)
            self.stats.hits += 1
            return seg
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._store(key, ids)

    def _store(self, key: str, ids: list[int], *, shared: bool = False) -> Segment:
        """Cache ``ids`` for ``key``; unless ``shared``, map them to the shared ints."""
        self.stats.misses += 1
        self.stats.tokens_encoded += len(ids)
        if not shared:
            ids = self._shared_ints(ids)
        seg: Segment = (next(self._serials), ids)
        cost = _cost(key, ids)
        if cost > self._max_tokens:
            return seg
        self._cache[key] = seg
        self._cached_tokens += cost
        while self._cached_tokens > self._max_tokens:
            old_key, (_, old) = self._cache.popitem(last=False)
            self._cached_tokens -= _cost(old_key, old)
            self.stats.evictions += 1
        return seg

    def _shared_ints(self, ids: list[int]) -> list[int]:
        """``ids`` as the vocabulary's shared int objects (ids are never negative; an id
        past the vocabulary keeps the tokenizer's own ints)."""
        try:
            if len(ids) > 1:
                return list(itemgetter(*ids)(self._ints))
            return [self._ints[ids[0]]] if ids else ids
        except IndexError:
            return ids

    def _probes(self) -> list[str]:
        tokens = sorted(self._added_ids)[:64]
        probes = ["", " ", "hello world", " leading space", "trailing space \n\n", "x\ty"]
        for tok in tokens:
            probes.append(f" a{tok} b\n{tok}{tok}  c {tok}")
            probes.append(f"{tok}\n\nHello, world!{tok} {tok}\t")
        return probes

    def _self_check(self) -> bool:
        for probe in self._probes():
            if self.encode_uncached(probe) != [i for _, ids in self._pieces(probe) for i in ids]:
                return False
        self.clear()
        return True

    def _learn_affixes(self) -> tuple[list[Segment], list[Segment]] | None:
        found: tuple[list[int], list[int]] | None = None
        for probe in ("hello world", " x\n", "ab <> 12"):
            plain = self.encode_uncached(probe)
            full = self.encode_uncached(probe, add_special_tokens=True)
            at = _find(full, plain)
            if at < 0:
                return None
            affix = (full[:at], full[at + len(plain) :])
            if found is not None and affix != found:
                return None
            found = affix
        if found is None:
            return None
        prefix, suffix = found
        return (
            [(-t - 1, (t,)) for t in prefix],
            [(-t - 1, (t,)) for t in suffix],
        )


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by slice comparisons (O(n) memcmp)."""
    n = min(len(a), len(b))
    if a.startswith(b) if len(b) <= len(a) else b.startswith(a):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _find(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1


__all__ = ["DEFAULT_MAX_CACHED_TOKENS", "Segment", "SegmentEncoder", "SegmentStats", "TextSplit"]
