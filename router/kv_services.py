"""Wiring of the KV-aware routing into the app: services and policy factories.

Registered through ``router.plugins`` (no proxy change):

* service ``kv`` (``start_kv``): builds, in order, the renderers (``index`` registry of
  ``scoring.models``, with a replica ``/tokenize`` fallback; with ``auto_models`` a model
  not listed is rendered by the replicas with the block size they report), the KV index
  (``memory`` or ``redis`` per ``settings.index``, wrapped in ``InstrumentedIndex``), the
  KV-event ingestion for every replica (its ``kv_events_endpoint``, else discovered at
  ``/kv_event_sources`` when ``discover_kv_events``; one owned task whose ``BlockStored``
  counts also feed the eviction-horizon estimator), and the ``/metrics`` scraper (one
  owned task; its samples feed the load terms and the horizon).  The ``router_index_*``
  and ``router_kv_events_*`` series (``router.index_metrics``) go on the app's registry
  (``ctx.metrics.registry``): lookups and writes are timed, ingestion is observed, the
  sources' statuses are read at scrape time and the per-replica block counts are
  refreshed by one more owned task.  It yields a ``KvServices``; teardown cancels and
  awaits those tasks, closes the index, then unregisters those series.
* policy ``kv`` (``kv_factory``) and policy ``session`` (``session_factory``).

``RegistryPrompts`` adapts ``index.RendererRegistry`` to the policy's ``PromptSource``:
a request that cannot be rendered exactly (``RenderError`` of any kind) has no prompt,
and the policy falls back to affinity; the replica still gets the request and answers
for itself (a malformed request is the replica's 400 to give, not the router's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from index.event_applier import BatchResult
from index.ingestion import KVEventIngestion, LeaseSettings, SourceSpec
from index.redis_store import RedisIndex
from index.status import SourceStatus
from index.store import KVIndex
from kvkeys.types import ReplicaId
from prompt.errors import RenderError
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer
from router.config import ScoringSettings
from router.horizon import HorizonEstimator, PoolSample
from router.index_metrics import FanOutObserver, IndexMetrics, keep_block_gauges
from router.kv_policy import KvConfig, KvPolicy
from router.kv_stack import check_index, instrumented_index
from router.plugins import PolicyContext, Service
from router.policy import RouteRequest
from router.scoring import CostModel, ScoringWeights
from router.scrape import MetricsScraper, ScrapeSample
from router.session_policy import SessionPolicy

__all__ = [
    "KvServices",
    "RegistryPrompts",
    "kv_config",
    "kv_factory",
    "kv_service",
    "session_factory",
    "start_kv",
]

_log = logging.getLogger(__name__)


class RegistryPrompts:
    """``PromptSource`` over an ``index`` renderer registry.

    With ``block_size_hint`` (auto models), a model the registry does not know is added
    on first sight without a tokenizer, so replicas render it (``/tokenize``), keyed
    with the block size the replicas report."""

    def __init__(
        self,
        registry: RendererRegistry,
        *,
        remote: bool = True,
        block_size_hint: Callable[[], int | None] | None = None,
    ) -> None:
        self.registry = registry
        self._remote = remote
        self._hint = block_size_hint

    async def prompt(self, request: RouteRequest, replica_url: str | None) -> Prompt | None:
        """The engine's prompt for ``request``, or ``None`` (see the module docstring)."""
        body = request.body
        if body is None:
            return None
        model = body.get("model")
        if model not in self.registry:
            if not self._learn(model):
                return None
        url = replica_url if self._remote else None
        try:
            if request.endpoint == "chat":
                return await self.registry.chat(body, replica_url=url)
            if request.endpoint == "completions":
                prompts = await self.registry.completion(body, replica_url=url)
                return prompts[0] if prompts else None
        except RenderError as exc:
            _log.debug("no prompt for request %s: %r", request.request_id, exc)
        return None

    def _learn(self, model: object) -> bool:
        if self._hint is None or not self._remote or not isinstance(model, str) or not model:
            return False
        block_size = self._hint()
        if block_size is None:
            return False
        self.registry.add(ModelSpec(name=model, block_size=block_size))
        _log.info("rendering model %r on the replicas (block size %d): list it under "
                  "scoring.models with its tokenizer to render locally", model, block_size)
        return True


@dataclass(slots=True)
class KvServices:
    """What the ``kv`` service yields: shared by the ``kv`` policy and ``/debug/route``."""

    prompts: RegistryPrompts
    index: KVIndex
    horizon: HorizonEstimator
    scraper: MetricsScraper | None
    ingestion: KVEventIngestion | None

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """The event-source snapshot of ``replica``, if it has a source."""
        return self.ingestion.status(replica) if self.ingestion is not None else None


class _HorizonObserver:
    """Feeds ``BlockStored`` counts into the horizon estimator (``IngestObserver``)."""

    def __init__(self, horizon: HorizonEstimator, ctx: PolicyContext) -> None:
        self._horizon = horizon
        self._clock = ctx.clock

    def batch_applied(self, replica: ReplicaId, result: BatchResult) -> None:
        if result.blocks_stored:
            self._horizon.observe_allocated(replica, self._clock(), result.blocks_stored)

    def gap(self, replica: ReplicaId) -> None:
        """Counted by the source status."""

    def dropped(self, replica: ReplicaId, reason: str, count: int = 1) -> None:
        """Counted by the source status."""

    def resync(self, replica: ReplicaId, reason: str) -> None:
        """Counted by the source status."""


def _model_specs(s: ScoringSettings) -> list[ModelSpec]:
    return [
        ModelSpec(
            name=m.name, block_size=m.block_size, tokenizer=m.tokenizer,
            chat_template=m.chat_template, content_format=m.content_format,
            default_chat_template_kwargs=dict(m.default_chat_template_kwargs),
            max_model_len=m.max_model_len, loras=tuple(m.loras),
        )
        for m in s.models
    ]


def _sources(ctx: PolicyContext) -> list[SourceSpec]:
    settings = ctx.settings
    default_model = settings.scoring.models[0].name if settings.scoring.models else None
    specs = []
    for r in settings.replicas:
        if r.kv_events_endpoint is None and not settings.scoring.discover_kv_events:
            continue
        # The key root: configured, else what the health prober read from /v1/models
        # (discovery asks the replica itself when neither is known).
        discovered = ctx.replicas[ReplicaId(r.id)].models
        model = (r.models[0] if r.models else default_model
                 or (discovered[0] if discovered else None))
        if r.kv_events_endpoint is not None and model is None:
            _log.warning("replica %s: no model known for its KV events; not ingested", r.id)
            continue
        specs.append(SourceSpec(
            replica=ReplicaId(r.id), model=model, url=r.url,
            endpoint=r.kv_events_endpoint, replay_endpoint=r.replay_endpoint,
        ))
    return specs


@asynccontextmanager
async def start_kv(ctx: PolicyContext) -> AsyncIterator[KvServices]:
    """Build renderers, index, ingestion and scraper (see the module docstring)."""
    s = ctx.settings.scoring
    remote = RemoteRenderer(ctx.http, timeout_s=s.remote_render_timeout_s)
    registry = RendererRegistry(_model_specs(s), remote=remote)
    horizon = HorizonEstimator(tau_s=s.horizon_tau_s, stale_s=3 * s.scrape.stale_after_s)
    index_metrics = IndexMetrics(ctx.metrics.registry)
    index = instrumented_index(ctx.settings.index, index_metrics)
    ingestion: KVEventIngestion | None = None
    scraper: MetricsScraper | None = None

    def block_size_hint() -> int | None:
        """The block size the replicas report (scrape first, then KV events)."""
        now = ctx.clock()
        for state in ctx.replicas.all():
            sample = scraper.latest(state.id, now) if scraper is not None else None
            if sample is not None and sample.block_size:
                return sample.block_size
            status = ingestion.status(state.id) if ingestion is not None else None
            if status is not None and status.block_size:
                return status.block_size
        return None

    prompts = RegistryPrompts(registry, remote=s.remote_render,
                              block_size_hint=block_size_hint if s.auto_models else None)
    tasks: list[asyncio.Task[Any]] = []
    try:
        await check_index(index)
        replicas = ctx.replicas
        tasks.append(ctx.tasks.spawn(
            keep_block_gauges(index, index_metrics,
                              lambda: [ReplicaId(st.id) for st in replicas.all()]),
            name="kv-index-gauges",
        ))  # fmt: skip
        specs = _sources(ctx)
        if specs:
            lease = None
            if isinstance(index.inner, RedisIndex):
                # Routers sharing a Redis index: one ingests each source (lease), every
                # router reads the sources' statuses from Redis.
                lease = LeaseSettings(client=index.inner.client,
                                      key_prefix=getattr(ctx.settings.index, "key_prefix",
                                                         "kvroute:"))
            observer = FanOutObserver(_HorizonObserver(horizon, ctx), index_metrics.observer())
            ingestion = KVEventIngestion(index, specs, http=ctx.http, lease=lease,
                                         observer=observer)
            index_metrics.watch_sources(ingestion.statuses)
            tasks.append(ctx.tasks.spawn(ingestion.run(), name="kv-events"))
            if ctx.settings.policy == "kv":
                await _await_live(ingestion, specs, s.startup_sync_s)
        if s.scrape.enabled:
            scraper = MetricsScraper(
                ctx.http, lambda: [(st.id, st.url) for st in replicas.all()],
                clock=ctx.clock, interval_s=s.scrape.interval_s, timeout_s=s.scrape.timeout_s,
                stale_after_s=s.scrape.stale_after_s,
            )
            scraper.add_listener(_pool_listener(horizon, lambda: ingestion))
            tasks.append(ctx.tasks.spawn(scraper.run(), name="kv-scrape"))
        yield KvServices(prompts, index, horizon, scraper, ingestion)
    finally:
        # Stop the tasks that use the index before closing it (the app's TaskOwner
        # would only cancel them after every service has exited).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await index.aclose()
        finally:
            index_metrics.close()


async def _await_live(
    ingestion: KVEventIngestion, specs: list[SourceSpec], timeout_s: float
) -> None:
    """Give the event sources up to ``timeout_s`` to connect and replay before traffic
    starts, so the first requests do not route on an index that is still filling.

    Configured endpoints are waited for; a replica found only by URL is waited for
    once its discovery succeeded (a replica without ``/kv_event_sources`` gets 0.5 s)."""
    if timeout_s <= 0:
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    explicit = [s.replica for s in specs if s.endpoint is not None]
    by_url = [s.replica for s in specs if s.endpoint is None]
    while loop.time() - start < timeout_s:
        statuses = ingestion.statuses()
        live = {r for r, st in statuses.items() if st.state == "live" and st.connected}
        pending = [r for r in explicit if r not in live]
        pending += [r for r in by_url if r in statuses and r not in live]
        undiscovered = [r for r in by_url if r not in statuses]
        if not pending and (not undiscovered or loop.time() - start > 0.5):
            return
        await asyncio.sleep(0.05)
    _log.warning("KV event sources not all live after %.1f s; routing starts anyway",
                 timeout_s)


def _pool_listener(
    horizon: HorizonEstimator, ingestion: Callable[[], KVEventIngestion | None]
) -> Callable[[ReplicaId, ScrapeSample], None]:
    def on_sample(replica: ReplicaId, sample: ScrapeSample) -> None:
        ing = ingestion()
        status = ing.status(replica) if ing is not None else None
        horizon.observe_scrape(replica, PoolSample(
            t=sample.t, block_size=sample.block_size, num_gpu_blocks=sample.num_gpu_blocks,
            kv_usage=sample.kv_usage,
            computed_prompt_tokens_total=sample.computed_prompt_tokens_total,
            generation_tokens_total=sample.generation_tokens_total,
        ), count_allocations=status is None or status.batches == 0)
    return on_sample


def kv_service() -> Service:
    """The ``kv`` service for ``router.plugins.builtin_services``."""
    return Service("kv", start_kv)


def kv_config(s: ScoringSettings) -> KvConfig:
    """The policy's copy of the scoring settings."""
    return KvConfig(
        weights=ScoringWeights(
            alpha=s.alpha, beta=s.beta, gamma=s.gamma, delta=s.delta,
            horizon_spread=s.horizon_spread,
            disconnected_trust=s.disconnected_trust, gap_trust=s.gap_trust,
            gap_window_s=s.gap_window_s, reset_trust=s.reset_trust,
            reset_window_s=s.reset_window_s,
        ),
        costs=CostModel(
            kv_bytes_per_token=s.kv_bytes_per_token, prefill_tokens_per_s=s.prefill_tokens_per_s,
            cpu_bandwidth_bytes_per_s=s.cpu_bandwidth_bytes_per_s,
            storage_bandwidth_bytes_per_s=s.storage_bandwidth_bytes_per_s,
        ),
        min_hit_tokens=s.min_hit_tokens,
        temperature=s.temperature,
        foreign_prefill_tokens_per_request=s.foreign_prefill_tokens_per_request,
        balance_abs_tokens=s.balance_abs_tokens,
        balance_rel=s.balance_rel,
        placement_tau_s=s.placement_tau_s,
        affinity_prefix_blocks=s.affinity_prefix_blocks,
        detect_prefix_breaks=s.detect_prefix_breaks,
        receipt_large_abs_tokens=s.receipt_large_abs_tokens,
        receipt_large_rel=s.receipt_large_rel,
        price_moves=s.price_moves,
    )


def kv_factory(ctx: PolicyContext) -> KvPolicy:
    """Build the ``kv`` policy (needs the ``kv`` service)."""
    from router.affinity import AffinityRing
    from router.provisional import ProvisionalBlocks
    from router.receipts import ReceiptCalibration
    from router.session_table import SessionTable

    svc: KvServices = ctx.services["kv"]
    s = ctx.settings.scoring
    replicas = ctx.replicas

    def url(replica: ReplicaId) -> str | None:
        return replicas[replica].url

    policy = KvPolicy(
        prompts=svc.prompts,
        index=svc.index,
        load=ctx.load,
        replica_url=url,
        statuses=svc.status,
        scraper=svc.scraper,
        horizon=svc.horizon,
        metrics=ctx.metrics.kv,
        config=kv_config(s),
        ring=AffinityRing(vnodes=s.affinity_vnodes),
        provisional=ProvisionalBlocks(ttl_s=s.provisional_ttl_s, max_keys=s.provisional_max_keys),
        sessions=SessionTable(max_sessions=s.max_sessions, max_token_bytes=s.session_token_bytes),
        calibration=ReceiptCalibration(weight=s.receipt_trust_weight,
                                       floor=s.receipt_trust_floor),
        clock=ctx.clock,
        rng=ctx.rng,
    )
    ctx.metrics.kv.bind_state(policy)
    return policy


def session_factory(ctx: PolicyContext) -> SessionPolicy:
    """Build the ``session`` policy."""
    from router.affinity import AffinityRing

    s = ctx.settings.scoring
    return SessionPolicy(ring=AffinityRing(vnodes=s.affinity_vnodes), metrics=ctx.metrics.kv,
                         clock=ctx.clock)
