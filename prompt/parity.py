"""Rendering drift detection: compare local prompts with a replica's ``/tokenize``.

A KV-aware router that renders differently from the engine routes blind without
noticing: every prediction misses.  ``ParityChecker`` samples live requests at
``sample_rate`` and asks a replica to tokenise the same request (``/tokenize`` with the
payload ``prompt.remote_render.tokenize_chat_payload`` builds, bypassing the remote
cache), then compares the ids with the prompt the router computed.

* A mismatch increments ``stats.mismatches``, is logged once per check at WARNING with
  the first differing position and a few ids of context on each side (ids, never text),
  and is passed to ``on_mismatch`` when given.
* Requests that ``/tokenize`` cannot reproduce exactly are skipped and counted:
  ``truncate_prompt_tokens`` (``/tokenize`` has no such field), and prompts that were not
  rendered locally.
* At most ``max_in_flight`` checks run at once; beyond that, samples are dropped
  (``stats.dropped``), so a slow replica never builds a queue.
* Every check has a timeout (``RemoteRenderer``'s); failures count in ``stats.errors``
  and never propagate.

The checker never runs on a request's critical path: the router calls
``should_sample()`` on the request path (cheap, no I/O) and, when true, runs
``check_chat``/``check_completion`` as a background task it owns (and cancels on
shutdown).  Randomness is injected (``rng``), so tests are deterministic.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prompt.errors import RenderError
from prompt.keyer import Prompt
from prompt.remote_render import RemoteRenderer, tokenize_chat_payload

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 4
"""Ids logged on each side of the first difference."""


@dataclass(slots=True)
class ParityStats:
    """Counters of the parity checker (plain ints, read by the router's metrics)."""

    checks: int = 0
    matches: int = 0
    mismatches: int = 0
    skipped: int = 0
    dropped: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first difference between the router's ids and the replica's."""

    model: str
    replica_url: str
    position: int
    """Index of the first differing token (or the shorter length)."""
    local_tokens: int
    remote_tokens: int
    local_context: tuple[int, ...]
    remote_context: tuple[int, ...]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ; ``None`` if equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


class ParityChecker:
    """Samples requests and checks the router's token ids against a replica's."""

    def __init__(
        self,
        remote: RemoteRenderer,
        *,
        sample_rate: float,
        rng: random.Random | None = None,
        max_in_flight: int = 4,
        on_mismatch: Callable[[Mismatch], None] | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError("sample_rate must be within [0, 1]")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._remote = remote
        self.sample_rate = sample_rate
        self._rng = rng if rng is not None else random.Random()
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._on_mismatch = on_mismatch
        self.stats = ParityStats()

    def should_sample(self) -> bool:
        """Whether to check the current request (no I/O; call on the request path)."""
        if self.sample_rate <= 0.0:
            return False
        if self._in_flight >= self._max_in_flight:
            if self._rng.random() < self.sample_rate:
                self.stats.dropped += 1
            return False
        return self._rng.random() < self.sample_rate

    async def check_chat(
        self,
        replica_url: str,
        body: Mapping[str, Any],
        local: Prompt,
        *,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> Mismatch | None:
        """Compare ``local`` (the router's rendering of chat ``body``) with the replica."""
        if local.source != "local" or body.get("truncate_prompt_tokens") is not None:
            self.stats.skipped += 1
            return None
        payload = tokenize_chat_payload(
            body, exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none
        )
        return await self._check(replica_url, str(body.get("model")), payload, local.token_ids)

    async def check_completion(
        self, replica_url: str, body: Mapping[str, Any], local: Sequence[Prompt]
    ) -> list[Mismatch]:
        """Compare each string prompt of completions ``body`` with the replica."""
        prompt = body.get("prompt")
        items = [prompt] if isinstance(prompt, str) else prompt
        if (
            body.get("truncate_prompt_tokens") is not None
            or not isinstance(items, list)
            or len(items) != len(local)
        ):
            self.stats.skipped += 1
            return []
        found: list[Mismatch] = []
        add_special = body.get("add_special_tokens", True) is not False
        for item, mine in zip(items, local, strict=True):
            if not isinstance(item, str) or mine.source != "local":
                continue
            payload = {
                "model": body.get("model"),
                "prompt": item,
                "add_special_tokens": add_special,
            }
            miss = await self._check(replica_url, str(body.get("model")), payload, mine.token_ids)
            if miss is not None:
                found.append(miss)
        return found

    async def _check(
        self, replica_url: str, model: str, payload: Mapping[str, Any], local: Sequence[int]
    ) -> Mismatch | None:
        self._in_flight += 1
        try:
            remote = await self._remote.tokenize(replica_url, payload, use_cache=False)
        except RenderError as exc:
            self.stats.errors += 1
            logger.info("render parity check against %s failed: %s", replica_url, exc)
            return None
        finally:
            self._in_flight -= 1
        self.stats.checks += 1
        at = first_difference(local, remote)
        if at is None:
            self.stats.matches += 1
            return None
        self.stats.mismatches += 1
        lo, hi = max(at - CONTEXT_TOKENS, 0), at + CONTEXT_TOKENS + 1
        miss = Mismatch(
            model=model,
            replica_url=replica_url,
            position=at,
            local_tokens=len(local),
            remote_tokens=len(remote),
            local_context=tuple(local[lo:hi]),
            remote_context=tuple(remote[lo:hi]),
        )
        logger.warning(
            "render parity mismatch model=%s replica=%s first_diff=%d local_len=%d "
            "remote_len=%d local_ids[%d:]=%s remote_ids[%d:]=%s",
            model,
            replica_url,
            at,
            len(local),
            len(remote),
            lo,
            list(miss.local_context),
            lo,
            list(miss.remote_context),
        )
        if self._on_mismatch is not None:
            self._on_mismatch(miss)
        return miss


__all__ = ["CONTEXT_TOKENS", "Mismatch", "ParityChecker", "ParityStats", "first_difference"]
