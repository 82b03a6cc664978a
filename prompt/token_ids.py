"""``TokenIds``: a prompt's token ids as a read-only sequence whose next turn is built in
time proportional to the new tokens, not to the whole conversation.

Turn N+1 of a conversation starts with turn N's ids up to the last added token that
both texts share (``prompt.segments``); only the ids after it are new.  Copying the shared
ids into a new list costs a pointer and a reference count per token: at 40 turns (25k
tokens) that is more than the rest of the warm turn's tokenisation.  So the ids live in
two parts:

* ``stem``: an ``array("I")`` (4 bytes per id) that only ever grows, shared by the turns
  of one conversation.  A turn uses its first ``length`` ids; a later turn that
  continues exactly where this one's stem ends appends to the same array, which changes
  nothing this turn can see.
* ``tail``: this turn's own ids after that point: those of the text after the last added
  token that every longer text starting with this one cuts at too (``prompt.segments``);
  a later turn takes over what of them its text shares.

A turn that continues from an earlier point of the stem (an edited or regenerated
conversation, or a sibling: the same history with another last message) copies the stem
up to there first, a ``memcpy`` of 4 bytes per id: ``extend`` decides by comparing
lengths, never by who else holds the array.  Equality, slicing (to lists) and iteration
behave as a list's.

``to_bytes`` (the ids as 4-byte unsigned ints, the form the router's session tracker
keeps) is the stem's own bytes and the tail's: no id is converted again.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import overload

_TYPECODE = "I"
"""4-byte unsigned ids (``array("I")`` is 4 bytes on CPython's platforms)."""


class TokenIds(Sequence[int]):
    """Token ids: the first ``length`` of a growing ``stem`` array, then ``tail``."""

    __slots__ = ("_stem", "_length", "_tail")

    def __init__(self, stem: Iterable[int], length: int, tail: list[int]) -> None:
        if not (isinstance(stem, array) and stem.typecode == _TYPECODE):
            stem = array(_TYPECODE, stem)
        if not 0 <= length <= len(stem):
            raise ValueError("length must be within the stem")
        self._stem: array[int] = stem
        self._length = length
        self._tail = tail

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        """Ids that share nothing (a fresh stem)."""
        stem = array(_TYPECODE, ids)
        return cls(stem, len(stem), [])

    def extend(self, keep: int, stem_ids: Iterable[int], tail: list[int]) -> TokenIds:
        """This turn's first ``keep`` ids, then ``stem_ids`` (kept for later turns) and
        ``tail`` (this turn's only).

        When the stem array ends exactly where this turn's stem part does, the kept ids
        and the new ones are appended to it (no turn uses the stem past its own length,
        so none sees them); otherwise the stem is copied up to there first."""
        if not 0 <= keep <= len(self):
            raise ValueError("a later turn keeps at most this turn's ids")
        n = self._length
        stem = self._stem
        if keep <= n:
            if len(stem) != keep:
                stem = stem[:keep]
        else:
            if len(stem) != n:
                stem = stem[:n]
            stem.extend(self._tail[: keep - n])
        stem.extend(stem_ids)
        return TokenIds(stem, len(stem), tail)

    @property
    def stem_length(self) -> int:
        """How many leading ids a later turn may keep without a copy."""
        return self._length

    def __len__(self) -> int:
        return self._length + len(self._tail)

    def __iter__(self) -> Iterator[int]:
        return chain(islice(self._stem, self._length), self._tail)

    def to_array(self, typecode: str = "I") -> array[int]:
        """The ids as an ``array`` (a C-level copy of the parts: packing a 25k-token
        prompt through iteration costs several times more)."""
        stem = self._stem[: self._length]
        out = stem if typecode == _TYPECODE else array(typecode, stem.tolist())
        out.extend(array(typecode, self._tail))
        return out

    def to_bytes(self) -> bytes:
        """The ids as 4-byte unsigned ints (``array("I").tobytes()``): the stem's bytes
        and the tail's (module docstring)."""
        n = self._length
        stem = self._stem
        head = stem.tobytes() if n == len(stem) else memoryview(stem)[:n].tobytes()
        return head + array(_TYPECODE, self._tail).tobytes() if self._tail else head

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n = self._length
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            if stop <= start:
                return []
            if stop <= n:
                return self._stem[start:stop].tolist()
            if start >= n:
                return self._tail[start - n : stop - n]
            return self._stem[start:n].tolist() + self._tail[: stop - n]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._stem[index] if index < n else self._tail[index - n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return len(self) == len(other) and self.tolist() == other.tolist()
        if isinstance(other, list):
            return len(self) == len(other) and self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like a list

    def tolist(self) -> list[int]:
        """The ids as a new list."""
        return self._stem[: self._length].tolist() + self._tail

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"
