"""Exact serialisation of plain data, to tell whether two request values are the same.

The rendering caches (``prompt.turns``, ``prompt.message_loop``) reuse work when a value
of this request equals a value of an earlier one.  Python's ``==`` is too loose for
that: ``True == 1 == 1.0``, ``0.0 == -0.0`` and dicts compare without their order, yet a
template prints each of them differently.  ``plain_bytes`` serialises a value with a
pickler that accepts only exact builtin types (``None``, ``bool``, ``int``, ``float``,
``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``), so that:

* equal bytes imply equal values, of the same types, in the same order (pickle is a
  faithful serialisation: the bytes rebuild an isomorphic object);
* anything else (a subclass, a custom object, a structure too deep) gives ``None``: the
  caller must not reuse anything for it.

Equal values may still give different bytes when the objects share references
differently (pickle records sharing); that only costs a cache miss.  This is an
equality test, not a hash: callers keep the bytes and compare them whole.
"""

from __future__ import annotations

import io
import pickle
from typing import NoReturn


class _PlainPickler(pickle.Pickler):
    """A pickler for exact builtin types only.

    CPython consults ``reducer_override`` for every object that is not ``None``, a bool
    or an exact ``int``, ``float``, ``bytes``, ``str``, ``dict``, ``set``,
    ``frozenset``, ``list`` or ``tuple``, so refusing there refuses everything else.
    """

    def reducer_override(self, obj: object) -> NoReturn:
        raise pickle.PicklingError(f"not plain data: {type(obj).__name__}")


def plain_bytes(value: object) -> bytes | None:
    """The exact serialisation of ``value``, or ``None`` if it is not plain data."""
    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except (pickle.PicklingError, RecursionError):
        return None
    return buffer.getvalue()


__all__ = ["plain_bytes"]
