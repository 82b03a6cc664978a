"""Rendering large prompts in a worker process, within a time budget.

Tokenising a long prompt takes long C calls that hold the GIL (a regular expression over
the whole text, the tokenizer's encode): on the event loop, or even in a thread, they
stall every other request for as long as they run (seconds for megabytes).  So prompts
with more than ``offload_chars`` characters of text are rendered by a worker process
that owns its own renderers (``index`` registry built from the same ``ModelSpec``s: the
same tokenizer files, templates and block sizes, so the same token ids and keys, with its
own per-conversation memo for the long conversations it sees).

``RenderWorker.render`` sends the body, waits at most ``budget_s`` and returns the
``Prompt``, or ``None`` (the policy then routes by affinity) when the budget runs out,
when ``max_pending`` renders are already waiting, or when the worker cannot render the
body.  A render that ran out of budget still finishes in the worker (it warms the
worker's memo for the conversation's next turn).  Token ids and keys come back packed
(4 and 8 bytes each) and are unpacked in C.

Lifecycle: the process is started on the first large prompt (``spawn``: nothing of the
router's state is inherited); ``aclose`` (the ``kv`` service's teardown) cancels what is
queued, terminates the process and reaps it.  The worker process keeps its registry in
a module variable: it is that process's only state.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sys
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypedDict

from prompt.errors import RenderError
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from router.policy import Endpoint

__all__ = ["MemoBounds", "RenderWorker"]

_log = logging.getLogger(__name__)

class MemoBounds(TypedDict):
    """A renderer registry's memo bounds (its keyword arguments)."""

    max_cached_tokens: int
    max_cached_words: int
    max_turn_bytes: int
    max_key_nodes: int


_Packed = tuple[bytes, bytes, int, str, str | None, str | None]
"""(token ids as u32, block keys as u64, block size, model, LoRA name, cache salt)."""

_registry: RendererRegistry | None = None
"""The worker process's renderers (set by ``_start`` in that process only)."""


def _start(specs: Sequence[ModelSpec], memos: MemoBounds | None) -> None:
    global _registry
    _registry = RendererRegistry(specs) if memos is None else RendererRegistry(specs, **memos)


def _render(endpoint: Endpoint, body: Mapping[str, Any]) -> _Packed | None:
    """In the worker process: the packed prompt, or ``None`` when it cannot be rendered."""
    assert _registry is not None
    try:
        if endpoint == "chat":
            prompt = _registry.render_chat(body)
        else:
            prompts = _registry.render_completion(body)
            if not prompts:
                return None
            prompt = prompts[0]
    except RenderError:
        return None
    ids = array("I", prompt.token_ids)
    keys = array("Q", prompt.block_keys)
    if sys.byteorder == "big":  # pragma: no cover - big-endian hosts only
        ids.byteswap()
        keys.byteswap()
    return (ids.tobytes(), keys.tobytes(), prompt.block_size, prompt.model, prompt.lora_name,
            prompt.cache_salt)


def _unpack(packed: _Packed) -> Prompt:
    raw_ids, raw_keys, block_size, model, lora_name, cache_salt = packed
    ids, keys = array("I"), array("Q")
    ids.frombytes(raw_ids)
    keys.frombytes(raw_keys)
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
        keys.byteswap()
    return Prompt(token_ids=ids.tolist(), block_keys=keys.tolist(),  # type: ignore[arg-type]
                  block_size=block_size, model=model, lora_name=lora_name,
                  cache_salt=cache_salt)  # (keys are ints: RequestKey is an int NewType)


class RenderWorker:
    """One worker process for large renders (see the module docstring)."""

    def __init__(
        self, specs: Sequence[ModelSpec], *, offload_chars: int, budget_s: float,
        max_pending: int, memos: MemoBounds | None = None,
    ) -> None:
        self._specs = tuple(s for s in specs if s.tokenizer is not None)
        self._memos = memos
        """The worker registry's memo bounds (``RendererRegistry`` keyword arguments)."""
        self.offload_chars = offload_chars
        self._budget_s = budget_s
        self._max_pending = max_pending
        self._pending = 0
        self._executor: ProcessPoolExecutor | None = None
        self.rendered = 0
        self.timed_out = 0
        self.refused = 0
        """Renders not attempted because ``max_pending`` were already waiting."""

    def takes(self, chars: int) -> bool:
        """Whether a prompt with ``chars`` characters of text is rendered here."""
        return bool(self._specs) and chars > self.offload_chars

    async def render(self, endpoint: Endpoint, body: Mapping[str, Any]) -> Prompt | None:
        """The prompt, or ``None`` past the budget or the queue bound."""
        if self._pending >= self._max_pending:
            self.refused += 1
            return None
        executor = self._executor
        if executor is None:
            executor = self._executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start, initargs=(self._specs, self._memos),
            )
        try:
            submitted = executor.submit(_render, endpoint, dict(body))
        except Exception as exc:  # the pool broke while idle (its process was killed)
            _log.warning("render worker unavailable: %r", exc)
            self._restart()
            return None
        self._pending += 1
        future = asyncio.wrap_future(submitted)
        future.add_done_callback(self._done)
        try:
            packed = await asyncio.wait_for(asyncio.shield(future), self._budget_s)
        except TimeoutError:
            self.timed_out += 1
            return None
        except Exception as exc:  # the worker died or could not take the body
            _log.warning("render worker failed: %r", exc)
            self._restart()
            return None
        if packed is None:
            return None
        self.rendered += 1
        return _unpack(packed)

    def _done(self, future: asyncio.Future[Any]) -> None:
        self._pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a failure is handled by the waiter

    def _restart(self) -> None:
        """Drop a broken pool; the next large prompt starts a fresh process."""
        self._stop()

    def _stop(self) -> list[Any]:
        executor, self._executor = self._executor, None
        if executor is None:
            return []
        processes = list(getattr(executor, "_processes", {}).values())
        # The worker is not killed: killed mid-message, it would leave the pool's result
        # reader waiting for the rest of a message and its feeder blocked on a full pipe
        # (both ends of the pool's pipes live in this process), so joining them (the
        # pool's clean-up, or the interpreter's exit) would hang for good.  It finishes
        # the render in hand (bounded by the body limit) and exits; what is queued is
        # cancelled.  A feeder left writing to a worker that died is not waited for.
        call_queue = getattr(executor, "_call_queue", None)
        if call_queue is not None:
            call_queue.cancel_join_thread()
        executor.shutdown(wait=False, cancel_futures=True)
        return processes

    async def aclose(self) -> None:
        """Cancel what is queued, let the worker finish its render and reap it (idempotent)."""
        for process in self._stop():
            await asyncio.to_thread(process.join, 5.0)
