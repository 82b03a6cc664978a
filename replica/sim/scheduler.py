"""Continuous-batching scheduler of the simulated replica (vLLM V1's, simplified).

One ``schedule(now)`` call plans a step; ``finish_step(plan)`` applies it once its
simulated duration has passed.  The scheduler owns the ``BlockPool`` and never looks at
a clock or does I/O: the engine (``replica.sim.engine``) supplies simulated time.

Policy, as in ``vllm/v1/core/sched/scheduler.py`` (FCFS, chunked prefill):

* A per-step token budget (``max_num_batched_tokens``).  Running requests go first,
  in arrival order: a decoding request takes 1 token, a prefilling one the rest of its
  prompt up to the budget (chunked prefill).
* A running request that needs a block when none is free preempts the *last* running
  request (its blocks are freed, its computed tokens reset, it goes back to the front of
  the queue), repeating until it fits or it preempted itself.
* Waiting requests are admitted in order while there is budget, fewer than
  ``max_num_seqs`` run, no preemption happened this step, and the whole prompt fits
  (``scheduler_reserve_full_isl``: ``cdiv(n, B) - hits + evictable hits`` blocks free).
  The head of the queue blocks the rest (FCFS).  A request that arrived after the
  step's start waits for the next step (the engine may plan a step after its start time
  has passed on the wall clock).
* Admission looks up the prefix cache: at most ``(n - 1) // B`` leading blocks (the last
  token is always recomputed), then the host tier for the blocks after the GPU hit.
  ``cached_tokens`` (usage) is fixed at the first admission; the prefix-cache counters
  (``vllm:prefix_cache_*``) count first admissions only, as vLLM's do (re-admissions of
  preempted requests go to its separate "preempted" figures, which are not exported).
* Blocks become cached when the tokens filling them are *scheduled* (vLLM caches in
  ``allocate_slots``), for prompt and generated tokens alike.
* After a step a request whose computed tokens reach its length samples one token
  (the first one ends prefill and fixes TTFT); ``max_tokens`` tokens finish it, and its
  blocks go back to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvkeys.keys import block_keys
from kvkeys.types import RequestKey
from replica.sim.block_pool import Block, BlockPool
from replica.sim.profiles import Profile

_MASK64 = (1 << 64) - 1
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407


class SimRequest:
    """One request inside the simulated engine."""

    __slots__ = (
        "request_id",
        "tokens",
        "num_prompt",
        "max_tokens",
        "cache_salt",
        "lora_name",
        "keys",
        "blocks",
        "num_cached_blocks",
        "num_computed",
        "num_cached_tokens",
        "num_preemptions",
        "rng",
        "arrival_s",
        "first_token_s",
        "finish_s",
        "finished",
        "on_output",
        "stream",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        keys: list[RequestKey],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        seed: int = 0,
        on_output: Callable[[SimRequest], None] | None = None,
        stream: bool = True,
    ) -> None:
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max(1, max_tokens)
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.keys = keys
        self.blocks: list[Block] = []
        self.num_cached_blocks = 0
        self.num_computed = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.rng = (seed * 0x9E3779B97F4A7C15 + 1) & _MASK64
        self.arrival_s = 0.0
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.finished = False
        self.on_output = on_output
        self.stream = stream
        """``on_output`` fires for every token when true, else only when finished."""

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        """Generated token ids so far."""
        return self.tokens[self.num_prompt :]


@dataclass(slots=True)
class StepPlan:
    """What one step computes: ``(request, new tokens)`` pairs and its duration."""

    scheduled: list[tuple[SimRequest, int]]
    duration_s: float
    prefill_tokens: int = 0
    decode_seqs: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Monotonic counters exposed as vLLM metrics."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    ttfts: list[float] = field(default_factory=list)
    """TTFT samples not yet collected (the metrics collector drains them)."""
    queue_times: list[float] = field(default_factory=list)
    """Arrival-to-first-admission samples not yet collected."""
    e2e_latencies: list[float] = field(default_factory=list)
    """Arrival-to-finish samples not yet collected."""
    fold_hook: Callable[[], None] | None = None
    """Called when samples pile up (past ``max_pending``); the collector drains them."""
    max_pending: int = 4096
    """Without a hook, older samples are dropped past this many (bounded memory)."""

    def overflow(self) -> None:
        """Keep the pending sample lists bounded."""
        if self.fold_hook is not None:
            self.fold_hook()
            return
        keep = self.max_pending // 2  # drop in halves, not one sample per step
        for samples in (self.ttfts, self.queue_times, self.e2e_latencies):
            del samples[: max(len(samples) - keep, 0)]


class Scheduler:
    """FCFS continuous batching over a ``BlockPool`` (see the module docstring)."""

    def __init__(
        self,
        pool: BlockPool,
        profile: Profile,
        *,
        model: str,
        vocab: list[int],
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        if not vocab:
            raise ValueError("vocab must not be empty")
        self.pool = pool
        self.profile = profile
        self.model = model
        self.vocab = vocab
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = SchedulerStats()

    # ---- request intake ------------------------------------------------------------

    def make_keys(
        self, prompt: list[int], *, cache_salt: str | None, lora_name: str | None
    ) -> list[RequestKey]:
        """Content keys of a prompt's full blocks (kvroute's own hash)."""
        return block_keys(
            prompt, self.block_size, model=self.model, cache_salt=cache_salt,
            lora_name=lora_name,
        )

    def add(self, req: SimRequest, now: float) -> None:
        """Queue a request that arrived at simulated time ``now``."""
        req.arrival_s = now
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away); its blocks return to the pool."""
        if req.finished:
            return
        req.finished = True
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req)

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """Plan one step at simulated time ``now`` (allocates blocks, queues events)."""
        pool = self.pool
        bs = self.block_size
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        decode_seqs = 0
        context_tokens = 0
        extra_s = 0.0
        preempted = False
        running = self.running
        free_queue = pool.free_queue  # len() of it is the number of free blocks
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            nc = req.num_computed
            n = len(req.tokens) - nc
            if n > budget:
                n = budget
            total = nc + n
            blocks = req.blocks
            if total > len(blocks) * bs:
                need = -(-total // bs) - len(blocks)
                ok = True
                while need > len(free_queue):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        ok = False
                        break
                if not ok:
                    break
                blocks.extend(pool.allocate(need))
            if total // bs > req.num_cached_blocks:
                self._cache(req, total)
            scheduled.append((req, n))
            budget -= n
            if nc >= req.num_prompt:
                decode_seqs += 1
                context_tokens += nc
            else:
                prefill_tokens += n
            i += 1

        waiting = self.waiting
        if not preempted:
            max_seqs = self.max_num_seqs
            host = pool.host_tier
            stats = self.stats
            while waiting and budget > 0 and len(running) < max_seqs:
                req = waiting[0]
                if req.arrival_s > now:  # arrived during the last step (engine's run loop)
                    break
                num_tokens = len(req.tokens)
                max_hit = (num_tokens - 1) // bs
                hit = pool.longest_hit(req.keys, max_hit)
                n_host = 0
                if host is not None and len(hit) < max_hit:
                    n_host = host.longest_hit(req.keys[len(hit) : max_hit])
                total_blocks = -(-num_tokens // bs)
                evictable = pool.num_evictable(hit)
                if total_blocks - len(hit) + evictable > pool.num_free:
                    break
                waiting.popleft()
                pool.touch(hit)
                req.blocks = hit
                computed = (len(hit) + n_host) * bs
                req.num_computed = computed
                # The hit blocks are already cached; host-loaded ones get stored anew.
                req.num_cached_blocks = len(hit)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = computed
                    stats.queue_times.append(now - req.arrival_s)
                if not req.num_preemptions:  # vLLM counts re-admissions separately
                    stats.prefix_queries += num_tokens
                    stats.prefix_hits += len(hit) * bs
                if n_host:
                    extra_s += host.load_seconds(n_host) if host is not None else 0.0
                n = min(num_tokens - computed, budget)
                need = -(-(computed + n) // bs) - len(req.blocks)
                if need > 0:
                    req.blocks.extend(pool.allocate(need))
                self._cache(req, computed + n)
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                prefill_tokens += n

        if not scheduled:
            return StepPlan([], 0.0)
        duration = (
            self.profile.step_seconds(prefill_tokens, decode_seqs, context_tokens) + extra_s
        )
        return StepPlan(scheduled, duration, prefill_tokens, decode_seqs)

    def finish_step(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Apply a planned step that ended at simulated time ``now``.

        Returns the requests that produced a token (finished ones included).
        """
        out: list[SimRequest] = []
        finished_any = False
        stats = self.stats
        vocab = self.vocab
        nv = len(vocab)
        bs = self.block_size
        model = self.model
        for req, n in plan.scheduled:
            if req.finished:  # aborted while the step ran
                continue
            nc = req.num_computed + n
            req.num_computed = nc
            tokens = req.tokens
            if nc < len(tokens):
                continue
            # Sample one token (deterministic per request seed).
            x = (req.rng * _LCG_A + _LCG_C) & _MASK64
            req.rng = x
            tokens.append(vocab[(x >> 33) % nv])
            n_tok = nc + 1
            if req.first_token_s is None:
                req.first_token_s = now
                stats.ttfts.append(now - req.arrival_s)
                stats.prompt_tokens += req.num_prompt
            if n_tok % bs == 0:
                keys = req.keys
                keys.extend(
                    block_keys(
                        tokens[-bs:], bs, model=model, cache_salt=req.cache_salt,
                        lora_name=req.lora_name, parent=keys[-1] if keys else None,
                        first_block_index=n_tok // bs - 1,
                    )
                )
            if n_tok - req.num_prompt >= req.max_tokens:
                req.finished = True
                req.finish_s = now
                stats.finished += 1
                stats.e2e_latencies.append(now - req.arrival_s)
                finished_any = True
                self._release(req)
            out.append(req)
        stats.generation_tokens += len(out)
        if finished_any:
            self.running = [r for r in self.running if not r.finished]
            if len(stats.e2e_latencies) > stats.max_pending or \
                    len(stats.ttfts) > stats.max_pending:
                stats.overflow()
        return out

    # ---- helpers -------------------------------------------------------------------

    def _cache(self, req: SimRequest, num_tokens: int) -> None:
        num_full = min(num_tokens, len(req.tokens)) // self.block_size
        if num_full > req.num_cached_blocks:
            self.pool.cache_full_blocks(
                req.blocks, req.keys, req.tokens, req.num_cached_blocks, num_full,
                cache_salt=req.cache_salt, lora_name=req.lora_name,
            )
            req.num_cached_blocks = num_full

    def _release(self, req: SimRequest) -> None:
        if req.blocks:
            self.pool.free(req.blocks)
            req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
