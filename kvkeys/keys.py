"""kvroute's block keys: the one place that knows how a token sequence becomes keys.

Specification (version 1).  For a model's block size ``B`` and a token sequence
``t[0..n)``, only the ``n // B`` full blocks get keys; the trailing partial block never
does, because vLLM never caches it.  Key ``k_i`` of block ``i`` is::

    k_i = xxh3_64( le_u64(k_{i-1}) || le_u32(t[iB]) ... le_u32(t[iB+B-1]) || extra_i )

where ``k_{-1}`` is the root ``xxh3_64(b"kvroute/v1\\x00" || utf8(model))``, and
``extra_i`` is, in this order,

* ``b"\\x00lora\\x00" || utf8(lora_name)`` on every block when a LoRA adapter serves the
  request (vLLM folds the adapter *name* into every block's hash), and
* ``b"\\x00salt\\x00" || utf8(cache_salt)`` on block 0 only when the request has a
  ``cache_salt`` (vLLM folds the salt into block 0; chaining carries it to the rest).

``model`` is the base model the replica serves, so two models sharing one index never
collide.  The function depends on nothing but its inputs: not on ``PYTHONHASHSEED``, not
on vLLM's hash algorithm or ``NONE_HASH`` seed.  The same function turns the
``token_ids`` of a ``BlockStored`` event into keys, continuing from the key of the
event's parent block, which is how prompts and events meet in the index.

A key of 0 is never produced on purpose; a collision with 0 is as unlikely as any other
64-bit collision and harmless.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

from kvkeys.types import RequestKey

_ROOT_PREFIX = b"kvroute/v1\x00"
_LORA_TAG = b"\x00lora\x00"
_SALT_TAG = b"\x00salt\x00"

_hash = xxhash.xxh3_64_intdigest


def root_key(model: str) -> RequestKey:
    """The parent of block 0 for ``model``."""
    return RequestKey(_hash(_ROOT_PREFIX + model.encode()))


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    *,
    model: str,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    parent: RequestKey | None = None,
    first_block_index: int = 0,
) -> list[RequestKey]:
    """Chained keys of the full blocks of ``tokens``.

    ``parent`` continues a chain (the key of the block before ``tokens[0]``); it
    defaults to the model's root.  ``first_block_index`` is the position of ``tokens[0]``
    in blocks, so the salt is applied only when the chain really starts at block 0.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    prev: int = root_key(model) if parent is None else parent
    lora = _LORA_TAG + lora_name.encode() if lora_name else b""
    salt = _SALT_TAG + cache_salt.encode() if cache_salt else b""
    width = 4 * block_size
    packed = memoryview(_le_u32(tokens[: n_blocks * block_size]))
    h = _hash
    # Written for speed (ingestion hashes every stored block): no per-block branches,
    # slices of one buffer, the ints appended as they are (a RequestKey is an int).
    keys: list[int] = []
    append = keys.append
    start = 0
    if first_block_index == 0 and salt:
        prev = h(prev.to_bytes(8, "little") + packed[:width] + lora + salt)
        append(prev)
        start = width
    end = n_blocks * width
    if lora:
        for s in range(start, end, width):
            prev = h(prev.to_bytes(8, "little") + packed[s : s + width] + lora)
            append(prev)
    else:
        for s in range(start, end, width):
            prev = h(prev.to_bytes(8, "little") + packed[s : s + width])
            append(prev)
    return keys  # type: ignore[return-value]


def _le_u32(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 (``array("I")`` is 4 bytes on CPython's platforms)."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**32)") from exc
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed.tobytes()


def expected_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens vLLM will serve from cache when ``matched_blocks`` leading blocks are held.

    vLLM always recomputes the last prompt token (``max_cache_hit_length = n - 1``), so
    at most ``(prompt_tokens - 1) // block_size`` blocks can hit.
    """
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    usable = min(matched_blocks, (prompt_tokens - 1) // block_size)
    return max(usable, 0) * block_size
