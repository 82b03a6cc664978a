"""``TokenIds``: a prompt's token ids as a read-only sequence whose next turn is built in
time proportional to the new tokens, not to the whole conversation.

Turn N+1 of a conversation starts with turn N's ids up to the last added token that
both texts share (``prompt.segments``); only the ids after it are new.  Copying the shared
ids into a new list costs a pointer and a reference count per token: at 40 turns (25k
tokens) that is more than the rest of the warm turn's tokenisation.  So the ids live in
two parts:

* ``stem``: a list that only ever grows, shared by the turns of one conversation.  A turn
  uses its first ``length`` ids; a later turn that continues exactly where this one's stem
  ends appends to the same list, which changes nothing this turn can see.
* ``tail``: this turn's own ids after that point: those of the text after the last added
  token that every longer text starting with this one cuts at too (``prompt.segments``);
  a later turn takes over what of them its text shares.

A turn that continues from an earlier point of the stem (an edited or regenerated
conversation) copies the stem up to there first: ``extend`` decides by comparing lengths,
never by who else holds the list.  Equality, slicing (to lists) and iteration behave as
a list's.

``to_bytes`` (the ids as 4-byte unsigned ints, the form the router's session tracker
keeps) converts each id once per stem: the packed stem is remembered next to the list
(4 bytes per id, made on the first call only) and a later turn's call converts only the
ids added since.  Because a stem only ever grows, what was packed stays true; a copied
stem starts from a copy of the packed bytes (a ``memcpy``, where converting 25k ids
costs tens of microseconds: a regenerated or sibling turn of a long conversation).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import overload

_WIDTH = array("I").itemsize


class _PackedStem:
    """The leading ids of one stem list, packed (``array("I")`` bytes); shared by the
    turns that share the list."""

    __slots__ = ("data",)

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def prefix(self, length: int) -> _PackedStem:
        """What of it a copy of the stem's first ``length`` ids starts with."""
        return _PackedStem(self.data[: length * _WIDTH])


class TokenIds(Sequence[int]):
    """Token ids: the first ``length`` of a growing ``stem`` list, then ``tail``."""

    __slots__ = ("_stem", "_length", "_tail", "_packed")

    def __init__(self, stem: list[int], length: int, tail: list[int]) -> None:
        if not 0 <= length <= len(stem):
            raise ValueError("length must be within the stem")
        self._stem = stem
        self._length = length
        self._tail = tail
        self._packed = _PackedStem()

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        """Ids that share nothing (a fresh stem)."""
        stem = list(ids)
        return cls(stem, len(stem), [])

    def extend(self, keep: int, stem_ids: Iterable[int], tail: list[int]) -> TokenIds:
        """This turn's first ``keep`` ids, then ``stem_ids`` (kept for later turns) and
        ``tail`` (this turn's only).

        When the stem list ends exactly where this turn's stem part does, the kept ids
        and the new ones are appended to it (no turn uses the stem past its own length,
        so none sees them); otherwise the stem is copied up to there first."""
        if not 0 <= keep <= len(self):
            raise ValueError("a later turn keeps at most this turn's ids")
        n = self._length
        stem = self._stem
        packed = self._packed
        if keep <= n:
            if len(stem) != keep:
                stem = stem[:keep]
                packed = packed.prefix(keep)
        else:
            if len(stem) != n:
                stem = stem[:n]
                packed = packed.prefix(n)
            stem.extend(self._tail[: keep - n])
        stem.extend(stem_ids)
        out = TokenIds(stem, len(stem), tail)
        out._packed = packed
        return out

    @property
    def stem_length(self) -> int:
        """How many leading ids a later turn may keep without a copy."""
        return self._length

    def __len__(self) -> int:
        return self._length + len(self._tail)

    def __iter__(self) -> Iterator[int]:
        return chain(islice(self._stem, self._length), self._tail)

    def to_array(self, typecode: str = "I") -> array[int]:
        """The ids as an ``array`` (a C-level copy of the list parts: packing a 25k-token
        prompt through iteration costs several times more)."""
        out = array(typecode, self._stem[: self._length] if self._length < len(self._stem)
                    else self._stem)
        out.extend(array(typecode, self._tail))
        return out

    def to_bytes(self) -> bytes:
        """The ids as 4-byte unsigned ints (``array("I").tobytes()``), converting only
        the stem ids no earlier call on this stem converted (module docstring)."""
        n = self._length
        packed = self._packed
        done = packed.data
        if len(done) < n * _WIDTH:
            new = array("I", self._stem[len(done) // _WIDTH : n]).tobytes()
            done = packed.data = done + new
        stem = done if len(done) == n * _WIDTH else done[: n * _WIDTH]
        return stem + array("I", self._tail).tobytes() if self._tail else stem

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
                return self._stem[start:stop]
            if start >= n:
                return self._tail[start - n : stop - n]
            return self._stem[start:n] + self._tail[: stop - n]
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
        return self._stem[: self._length] + self._tail

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"
