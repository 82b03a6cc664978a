"""Settings of the ``kv`` policy (the ``scoring`` section of ``RouterSettings``; see
``router.config``): the models it renders, the score's weights and costs, scraping, the
render worker and the prompt memos."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.scoring import CostModel, ScoringWeights

__all__ = [
    "ModelSettings",
    "PromptMemorySettings",
    "RenderWorkerSettings",
    "ScoringSettings",
    "ScrapeSettings",
]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ModelSettings(_Section):
    """A model the ``kv`` policy renders and hashes exactly as its replicas do."""

    name: str
    """The served model name clients send in ``model``."""
    block_size: int = Field(default=16, gt=0)
    """The replicas' KV block size (``--block-size``: 16 on GPU by default, 128 on vLLM's
    CPU build).  Must match the replicas, or no prediction will ever hit."""
    tokenizer: str | None = None
    """Local tokenizer directory (or cached Hugging Face id); ``None``: replicas render
    (``/tokenize``) on every request, which costs a round trip."""
    chat_template: str | None = None
    """The replicas' ``--chat-template`` (path or literal), if they use one."""
    content_format: Literal["auto", "string", "openai"] = "auto"
    """The replicas' ``--chat-template-content-format``."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The replicas' ``--default-chat-template-kwargs``."""
    max_model_len: int | None = None
    """The replicas' ``--max-model-len`` (needed for ``truncate_prompt_tokens=-1``)."""
    loras: list[str] = Field(default_factory=list)
    """LoRA adapter names served on top of this model."""


class ScrapeSettings(_Section):
    """Scraping each replica's ``/metrics`` for load other routers add."""

    enabled: bool = True
    """Scrape at all (off: the router's own accounting only)."""
    interval_s: float = Field(default=1.0, gt=0)
    """Time between scrape rounds: vLLM refreshes its gauges every scheduler step, and a
    second keeps the cost to one small GET per replica per second."""
    timeout_s: float = Field(default=0.5, gt=0)
    """One scrape; a slower replica's sample is skipped (unknown, not zero)."""
    stale_after_s: float = Field(default=3.0, gt=0)
    """A sample older than this is unknown (three missed rounds)."""


_WEIGHTS = ScoringWeights()
_COSTS = CostModel()


class RenderWorkerSettings(_Section):
    """Large prompts: refused early when they cannot fit, else rendered off the loop."""

    enabled: bool = True
    """Render prompts longer than ``offload_chars`` in a worker process (off: on the
    event loop, stalling every other request meanwhile)."""
    offload_chars: int = Field(default=32768, ge=0)
    """Characters of prompt text above which rendering leaves the event loop (about
    10k tokens: some 10-30 ms of tokenising, depending on the tokenizer)."""
    budget_s: float = Field(default=1.0, gt=0)
    """Longest wait for a worker render; past it the request is routed by affinity."""
    max_pending: int = Field(default=4, ge=1)
    """Worker renders waiting at once; more large prompts are routed by affinity."""


class PromptMemorySettings(_Section):
    """Bounds of each locally rendered model's per-prompt memos (what a conversation's next
    turn reuses), in each memo's unit with its size in bytes: ~200 MB per model by
    default, and as much again in the render worker process."""

    piece_cache_tokens: int = Field(default=2_000_000, ge=0)
    """Tokenised text pieces, in token ids (a piece's ids, plus one per 4 characters of
    its text, plus 8): about 26 bytes each, 52 MB by default."""
    word_cache_words: int = Field(default=200_000, ge=0)
    """Tokenised words (and 8 characters per word): about 175 bytes each, 35 MB."""
    turn_memo_bytes: int = Field(default=64_000_000, ge=0)
    """Each conversation's last turn, counted in characters (about twice in bytes)."""
    key_memo_units: int = Field(default=200_000, ge=1)
    """Block-key chain states, in units of about 200 bytes (a state, or five keys):
    40 MB (shared by the models)."""


class ScoringSettings(_Section):
    """Knobs of the ``kv`` policy (formula in ``router.scoring``).

    The score's weights and costs take their defaults from ``ScoringWeights`` and
    ``CostModel``, where they are sized; the policy gets them through ``kv_config``
    (``router.kv_services``), which copies every field by name."""

    alpha: float = Field(default=_WEIGHTS.alpha, ge=0)
    """Weight of the prefill tokens the replica would compute for the request."""
    beta: float = Field(default=_WEIGHTS.beta, ge=0)
    """Weight of the prefill tokens already queued there (same unit: equal by default,
    so the score is the prefill ahead of the first token)."""
    gamma: float = Field(default=_WEIGHTS.gamma, ge=0)
    """Prefill tokens one decoding sequence is worth (it shares every batch step)."""
    delta: float = Field(default=_WEIGHTS.delta, ge=0)
    """Prefill tokens one recent new conversation on a replica is worth, for placing new
    conversations: sticky sessions are future load the queue does not show under paced
    traffic, so a prefix one replica holds is replicated once the imbalance exceeds
    about its length / delta sessions (no single-replica hotspot)."""
    placement_tau_s: float = Field(default=300.0, gt=0)
    """Decay time of the recent-placements count (about a conversation's lifetime)."""
    min_hit_tokens: int = Field(default=64, ge=0)
    """Below this many expected cached tokens on the best replica, use session affinity
    (four 16-token blocks: less is a chat template's boilerplate, not a conversation)."""
    temperature: float = Field(default=0.0, ge=0)
    """Softmax temperature in tokens for sampling among replicas; 0 = best score, ties
    by the request's affinity ring order."""
    kv_bytes_per_token: float = Field(default=_COSTS.kv_bytes_per_token, gt=0)
    """KV cache bytes per token (layers x KV heads x head dim x 2 x dtype bytes);
    128 KiB is Llama-3-8B in bf16."""
    prefill_tokens_per_s: float = Field(default=_COSTS.prefill_tokens_per_s, gt=0)
    """A replica's prefill rate; sets the queue wait and the value of offloaded blocks."""
    cpu_bandwidth_bytes_per_s: float = Field(default=_COSTS.cpu_bandwidth_bytes_per_s, ge=0)
    """Host-to-device bandwidth for reloading CPU-offloaded blocks (PCIe Gen4 ~25 GB/s)."""
    storage_bandwidth_bytes_per_s: float = Field(default=_COSTS.storage_bandwidth_bytes_per_s, ge=0)
    """Bandwidth for reloading blocks from storage (NVMe ~3 GB/s)."""
    horizon_spread: float = Field(default=_WEIGHTS.horizon_spread, ge=0, le=1)
    """Relative uncertainty of the eviction horizon."""
    horizon_tau_s: float = Field(default=30.0, gt=0)
    """Time constant of the block allocation rate average."""
    disconnected_trust: float = Field(default=_WEIGHTS.disconnected_trust, ge=0, le=1)
    """Index trust for a replica whose event stream is disconnected."""
    gap_trust: float = Field(default=_WEIGHTS.gap_trust, ge=0, le=1)
    """Index trust right after missed events (recovers over ``gap_window_s``)."""
    gap_window_s: float = Field(default=_WEIGHTS.gap_window_s, ge=0)
    """Recovery window after a gap."""
    reset_trust: float = Field(default=_WEIGHTS.reset_trust, ge=0, le=1)
    """Index trust right after a reset or restart (recovers over ``reset_window_s``)."""
    reset_window_s: float = Field(default=_WEIGHTS.reset_window_s, ge=0)
    """Recovery window after a reset."""
    foreign_prefill_tokens_per_request: float = Field(default=512.0, ge=0)
    """Prefill tokens assumed per scraped waiting request that is not ours."""
    balance_abs_tokens: float = Field(default=4096.0, ge=0)
    """Affinity fallback only: leave the pinned replica when its load (in prefill
    tokens) exceeds the least loaded by this much ..."""
    balance_rel: float = Field(default=2.0, ge=1)
    """... and by this factor."""
    affinity_prefix_blocks: int = Field(default=8, ge=1)
    """Blocks of the prompt hashed for the affinity key when there is no session key
    and no chat message to key on."""
    affinity_vnodes: int = Field(default=160, ge=1)
    """Points per replica on the consistent-hash ring."""
    provisional_ttl_s: float = Field(default=10.0, ge=0)
    """How long a routed request's blocks count as held before events confirm them."""
    provisional_max_keys: int = Field(default=1_000_000, ge=0)
    """Bound on provisional entries (~120 bytes each with expiry and slots: 120 MB)."""
    max_sessions: int = Field(default=100_000, ge=0)
    """Sessions remembered (stickiness, think time, prefix breaks)."""
    session_token_bytes: int = Field(default=64 << 20, ge=0)
    """Bytes of session state: each session's last prompt (4 per token, for prefix-break
    detection), its message digests and 512 for the entry (LRU eviction)."""
    detect_prefix_breaks: bool = True
    """Compare each session's new prompt with its previous one (explicit session keys)."""
    price_moves: bool = True
    """Charge moving a conversation off the replica holding its context what it costs
    the fleet (recomputation delaying others on a busy target, displaced and stranded
    cache; ``router.move_cost``), not just the request.  Off: the request's cost only."""
    price_placements: bool = True
    """Charge placing a new conversation on a replica the reusable cache its context
    displaces there (the mean conversation footprint, learnt from finished turns, times
    the replica's learnt reuse share; ``router.move_cost``), so new conversations go
    where the cache is lost anyway rather than evenly into every cache.  Off: placed by
    the request's cost and recent placements only."""
    price_future: bool = True
    """Look ahead (``router.fleet_outlook``): charge each placement the returning
    conversations' context its allocations evict, credit what the conversation itself
    keeps between turns, charge the wait for pool space, and let a later turn queue on
    its own replica up to the fleet's recent TTFT at ``stay_quantile``."""
    future_weight: float = Field(default=1.0, ge=0)
    """Weight of a forecast future hit (an expected token of context kept or evicted)
    against a token computed now: 1, a token is a token."""
    stay_quantile: float | None = Field(default=0.99, ge=0, le=1)
    """TTFT quantile (learnt from receipts) up to which a later turn is not charged the
    queue on the replica holding its context (the tail it keeps requests out of: p99);
    ``null``: off."""
    pool_headroom: bool = True
    """Charge a replica the wait until its pool holds the request beside this router's
    requests in flight there."""
    receipt_large_abs_tokens: int = Field(default=64, ge=0)
    """A receipt disagrees largely when off by more than this many tokens ..."""
    receipt_large_rel: float = Field(default=0.1, ge=0)
    """... and by more than this share of the prompt."""
    receipt_trust_weight: float = Field(default=0.05, ge=0, le=1)
    """How fast a replica's hit trust follows its receipts."""
    receipt_trust_floor: float = Field(default=0.2, ge=0, le=1)
    """The lowest hit trust receipts can drive a replica to."""
    discover_kv_events: bool = True
    """Replicas without ``kv_events_endpoint``: find their KV event streams at ``GET
    /kv_event_sources`` (vLLM 0.31+, the simulated replica); retried slowly if absent."""
    startup_sync_s: float = Field(default=3.0, ge=0)
    """At start-up, wait up to this long for the KV event sources to be connected and
    replayed before serving (the first requests would otherwise route blind)."""
    auto_models: bool = True
    """A requested model not listed in ``models`` is rendered by a replica (``/tokenize``)
    with the block size the replicas report (``vllm:cache_config_info``): KV routing
    works unconfigured, at the cost of one round trip per request.  List the model with
    its tokenizer to render locally instead."""
    remote_render: bool = True
    """Ask a replica (``/tokenize``) when a prompt cannot be rendered locally."""
    remote_render_timeout_s: float = Field(default=2.0, gt=0)
    """One remote render."""
    models: list[ModelSettings] = Field(default_factory=list)
    """Models rendered for KV routing; a model not listed is routed by affinity."""
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    """Replica ``/metrics`` scraping."""
    render_worker: RenderWorkerSettings = Field(default_factory=RenderWorkerSettings)
    """Large prompts (early refusal, worker process, time budget)."""
    prompt_memory: PromptMemorySettings = Field(default_factory=PromptMemorySettings)
    """Bounds of the per-prompt memos, in bytes (see each field)."""
