"""Wiring of the KV-aware routing into the app: the ``kv`` service and policy factories.

Registered through ``router.builtin_plugins`` (no proxy change):

* service ``kv`` (``start_kv``): the renderers (a ``prompt`` registry of
  ``scoring.models``, with a replica ``/tokenize`` fallback; with ``auto_models`` a model
  not listed is rendered by the replicas with the block size they report), the KV stack
  (``router.kv_stack``: index, ingestion, block gauges; its ``BlockStored`` counts also
  feed the eviction-horizon estimator) and the ``/metrics`` scraper (one owned task; its
  samples feed the load terms and the horizon).  It yields a ``KvServices``; teardown
  stops the scraper, then the stack.
* policy ``kv`` (``kv_factory``, its numbers from ``kv_config``) and policy ``session``
  (``session_factory``).

``RegistryPrompts`` adapts the renderer registry to the policy's ``PromptSource``:
a request that cannot be rendered exactly (``RenderError`` of any kind) has no prompt,
and the policy falls back to affinity; the replica still gets the request and answers
for itself (a malformed request is the replica's 400 to give, not the router's).  Two
exceptions for large prompts (``router.prompt_bounds``, ``router.render_worker``): a
prompt whose text alone cannot fit the model's context (``max_model_len``, configured or
reported by the replicas' ``/v1/models``) is refused with vLLM's 400 before any
tokenising, and a prompt with more than ``render_worker.offload_chars`` characters is
rendered in a worker process within ``render_worker.budget_s`` (else affinity).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from index.ingestion import SourceSpec
from index.status import SourceStatus
from index.store import KVIndex
from kvkeys.types import ReplicaId
from prompt.errors import RenderError
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer
from router.block_size_check import BlockSizeCheck
from router.config import ScoringSettings
from router.fleet_outlook import OutlookSettings
from router.horizon import HorizonEstimator, PoolSample
from router.index_metrics import IndexMetrics
from router.kv_ingest_observer import KvIngestObserver, ReplicaResets
from router.kv_members import MemberIngestion
from router.kv_policy import KvConfig, KvPolicy
from router.kv_stack import Membership, open_kv_stack
from router.metrics import RemoteRenderCollector
from router.outlook_peers import OutlookPeers, open_outlook_peers
from router.plugins import PolicyContext, Service
from router.policy import RouteRequest
from router.prompt_bounds import max_chars_per_token, prompt_chars, too_long
from router.render_worker import MemoBounds, RenderWorker
from router.replica_registry import ReplicaRegistry
from router.scoring import CostModel, ScoringWeights
from router.scrape import MetricsScraper, ScrapeSample
from router.session_policy import SessionPolicy

__all__ = [
    "KvServices",
    "RegistryPrompts",
    "copy_fields",
    "kv_config",
    "kv_factory",
    "kv_service",
    "session_factory",
    "start_kv",
]

_log = logging.getLogger(__name__)


class RegistryPrompts:
    """``PromptSource`` over a ``prompt`` renderer registry.

    With ``block_size_hint`` (auto models), a model the registry does not know is added
    on first sight without a tokenizer, so replicas render it (``/tokenize``), keyed
    with the block size the replicas report; only a model that ``served`` says a
    replica lists is added (a client's made-up name creates no state).  A model
    ``disabled`` says is off (its replicas use another block size) has no prompt."""

    def __init__(
        self,
        registry: RendererRegistry,
        *,
        remote: bool = True,
        block_size_hint: Callable[[], int | None] | None = None,
        disabled: Callable[[str], bool] | None = None,
        served: Callable[[str], bool] = lambda model: False,
        max_model_len: Callable[[str], int | None] = lambda model: None,
        worker: RenderWorker | None = None,
    ) -> None:
        self.registry = registry
        self._remote = remote
        self._hint = block_size_hint
        self._disabled = disabled
        self._served = served
        self._max_model_len = max_model_len
        self.worker = worker
        # Per model with a local tokenizer: the most characters one token stands for.
        self._chars_per_token: dict[str, int | None] = {}
        for name in registry.models():
            renderer = registry.resolve(name).renderer
            if renderer is not None:
                self._chars_per_token[name] = max_chars_per_token(renderer.files.tokenizer)

    async def prompt(self, request: RouteRequest, replica_url: str | None) -> Prompt | None:
        """The engine's prompt for ``request``, or ``None`` (see the module docstring)."""
        body = request.body
        if body is None:
            return None
        model = body.get("model")
        if model not in self.registry:
            if not self._learn(model):
                return None
        assert isinstance(model, str)
        chars = prompt_chars(request.endpoint, body)
        refusal = too_long(request.endpoint, body, chars, self._chars_per_token.get(model),
                           self._max_model_len(model))
        if refusal is not None:
            raise refusal  # cannot fit the context: vLLM's 400, without tokenising
        if self._disabled is not None and self._disabled(model):
            return None  # its replicas use another block size (router.block_size_check)
        if (self.worker is not None and self.worker.takes(chars)
                and model in self._chars_per_token):
            return await self.worker.render(request.endpoint, body)
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
        if not self._served(model):
            return False  # a client's name creates no state: only models replicas list
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
    ingestion: MemberIngestion | None
    resets: ReplicaResets = field(default_factory=ReplicaResets)
    peers: OutlookPeers | None = None
    """The other workers' look-ahead news (``kvroute serve --workers N``)."""

    def status(self, replica: ReplicaId) -> SourceStatus | None:
        """The event-source snapshot of ``replica``, if it has a source."""
        return self.ingestion.status(replica) if self.ingestion is not None else None

    def readiness(self) -> dict[str, Any]:
        """The ``kv_events`` detail of ``/ready`` (``router.readiness``)."""
        if self.ingestion is None:
            return {"ok": True, "failing": {}, "restarts": {}, "sources": {}, "connected": 0}
        health = self.ingestion.health()
        statuses = self.ingestion.statuses()
        return {
            "ok": health.ok,
            "failing": health.failing,
            "restarts": health.restarts,
            "sources": {rid: st.state for rid, st in sorted(statuses.items())},
            "connected": sum(1 for st in statuses.values() if st.connected),
        }


def _model_specs(s: ScoringSettings) -> list[ModelSpec]:
    return [copy_fields(ModelSpec, m.model_dump(), loras=tuple(m.loras)) for m in s.models]


def _memo_bounds(s: ScoringSettings) -> MemoBounds:
    """The renderer registry's memo bounds (``scoring.prompt_memory``)."""
    m = s.prompt_memory
    return MemoBounds(max_cached_tokens=m.piece_cache_tokens,
                      max_cached_words=m.word_cache_words, max_turn_bytes=m.turn_memo_bytes,
                      max_key_nodes=m.key_memo_units)


def _spec(ctx: PolicyContext, replica: ReplicaId) -> SourceSpec | None:
    """The event source of one member replica, or ``None`` if it is not ingested."""
    settings = ctx.settings
    state = ctx.replicas.get(replica)
    if state is None or state.settings is None:
        return None
    r = state.settings
    if r.kv_events_endpoint is None and not settings.scoring.discover_kv_events:
        return None
    default_model = settings.scoring.models[0].name if settings.scoring.models else None
    # The key root: configured, else what the health prober read from /v1/models
    # (discovery asks the replica itself when neither is known).
    discovered = state.models
    model = (r.models[0] if r.models else default_model
             or (discovered[0] if discovered else None))
    if r.kv_events_endpoint is not None and model is None:
        _log.warning("replica %s: no model known for its KV events; not ingested", r.id)
        return None
    return SourceSpec(replica=ReplicaId(r.id), model=model, url=r.url,
                      endpoint=r.kv_events_endpoint, replay_endpoint=r.replay_endpoint)


@dataclass(slots=True)
class _Running:
    """The ingestion and the scraper once started, as the renderers' hints read them."""

    replicas: ReplicaRegistry
    clock: Callable[[], float]
    ingestion: MemberIngestion | None = None
    scraper: MetricsScraper | None = None

    def block_size_hint(self) -> int | None:
        """The block size the replicas report (scrape first, then KV events)."""
        now = self.clock()
        scraper, ingestion = self.scraper, self.ingestion
        for state in self.replicas.all():
            sample = scraper.latest(state.id, now) if scraper is not None else None
            if sample is not None and sample.block_size:
                return sample.block_size
            status = ingestion.status(state.id) if ingestion is not None else None
            if status is not None and status.block_size:
                return status.block_size
        return None

    def model_of(self, replica: ReplicaId) -> str | None:
        ingestion = self.ingestion
        source = ingestion.sources.get(replica) if ingestion is not None else None
        return source.model if source is not None else None


@asynccontextmanager
async def start_kv(ctx: PolicyContext) -> AsyncIterator[KvServices]:
    """Build renderers, the KV stack and the scraper (see the module docstring)."""
    s = ctx.settings.scoring
    remote = RemoteRenderer(ctx.http, timeout_s=s.remote_render_timeout_s)
    memos = _memo_bounds(s)
    registry = RendererRegistry(_model_specs(s), remote=remote, **memos)
    remote_counters = RemoteRenderCollector(remote.stats)
    horizon = HorizonEstimator(tau_s=s.horizon_tau_s, stale_s=3 * s.scrape.stale_after_s)
    resets = ReplicaResets()
    index_metrics = IndexMetrics(ctx.metrics.registry)
    running = _Running(ctx.replicas, ctx.clock)
    sizes = _block_size_check(s, registry, running, index_metrics)
    worker = _render_worker(s, memos)
    prompts = _registry_prompts(ctx, registry, running, sizes, worker)
    ctx.metrics.registry.register(remote_counters)
    try:
        async with open_kv_stack(
            ctx.settings, index_metrics, tasks=ctx.tasks, http=ctx.http,
            membership=Membership(lambda: ctx.replicas.ids, partial(_spec, ctx),
                                  ctx.replicas.on_membership),
            observers=(KvIngestObserver(horizon, ctx.clock, resets), sizes),
            gauge_replicas=lambda: [ReplicaId(st.id) for st in ctx.replicas.all()],
        ) as stack:  # fmt: skip
            running.ingestion = stack.ingestion
            if stack.specs and ctx.settings.policy == "kv":
                await _await_live(stack.ingestion, stack.specs, s.startup_sync_s)
            scraping = _start_scraper(ctx, horizon, running)
            try:
                async with open_outlook_peers(
                    ctx.settings, ctx.peers, clock=ctx.clock, tasks=ctx.tasks,
                    registry=ctx.metrics.registry,
                    known=lambda r: ctx.replicas.get(r) is not None,
                ) as peers:
                    yield KvServices(prompts, stack.index, horizon, running.scraper,
                                     stack.ingestion, resets, peers)  # fmt: skip
            finally:
                if scraping is not None:  # stopped before the stack closes the index
                    scraping.cancel()
                    await asyncio.gather(scraping, return_exceptions=True)
    finally:
        try:
            if worker is not None:
                await worker.aclose()
        finally:
            ctx.metrics.registry.unregister(remote_counters)


def _block_size_check(s: ScoringSettings, registry: RendererRegistry, running: _Running,
                      metrics: IndexMetrics) -> BlockSizeCheck:  # fmt: skip
    """Turns a model off when its replicas use another block size than configured."""

    def base_of(model: str) -> str | None:
        return registry.resolve(model).spec.name if model in registry else None

    return BlockSizeCheck({m.name: m.block_size for m in s.models}, model_of=running.model_of,
                          base_of=base_of, mismatches=metrics.block_size_mismatch)


def _render_worker(s: ScoringSettings, memos: MemoBounds) -> RenderWorker | None:
    """The worker process for large prompts, if ``scoring.render_worker`` enables it."""
    w = s.render_worker
    if not w.enabled:
        return None
    specs = {spec.name: spec for spec in _model_specs(s)}
    return RenderWorker(list(specs.values()), offload_chars=w.offload_chars, budget_s=w.budget_s,
                        max_pending=w.max_pending, memos=memos)


def _registry_prompts(
    ctx: PolicyContext,
    registry: RendererRegistry,
    running: _Running,
    sizes: BlockSizeCheck,
    worker: RenderWorker | None,
) -> RegistryPrompts:
    """The policy's ``PromptSource``, with the fleet's hints."""
    s = ctx.settings.scoring
    model_specs = {spec.name: spec for spec in _model_specs(s)}

    def max_model_len(model: str) -> int | None:
        """The configured context length, else the least the replicas report."""
        spec = model_specs.get(model)
        if spec is not None and spec.max_model_len is not None:
            return spec.max_model_len
        return ctx.replicas.max_model_len(model)

    return RegistryPrompts(registry, remote=s.remote_render,
                           block_size_hint=running.block_size_hint if s.auto_models else None,
                           served=ctx.replicas.lists, max_model_len=max_model_len,
                           worker=worker, disabled=sizes.disabled)


def _start_scraper(ctx: PolicyContext, horizon: HorizonEstimator,
                   running: _Running) -> asyncio.Task[Any] | None:  # fmt: skip
    """Start the ``/metrics`` scraper (``scoring.scrape``) as a supervised task; its
    samples feed the horizon."""
    s = ctx.settings.scoring
    if not s.scrape.enabled:
        return None
    replicas = ctx.replicas
    scraper = MetricsScraper(
        ctx.http, lambda: [(st.id, st.url) for st in replicas.all()],
        clock=ctx.clock, interval_s=s.scrape.interval_s, timeout_s=s.scrape.timeout_s,
        stale_after_s=s.scrape.stale_after_s, time_scale=ctx.settings.time_scale,
    )
    scraper.add_listener(_pool_listener(horizon, lambda: running.ingestion))
    running.scraper = scraper
    return ctx.tasks.supervise(scraper.run, name="kv-scrape")


async def _await_live(
    ingestion: MemberIngestion, specs: list[SourceSpec], timeout_s: float
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
    horizon: HorizonEstimator, ingestion: Callable[[], MemberIngestion | None]
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
    """The ``kv`` service for ``router.builtin_plugins.builtin_services``."""
    return Service("kv", start_kv)


def kv_config(s: ScoringSettings) -> KvConfig:
    """The policy's numbers: every field of ``KvConfig``, ``ScoringWeights`` and
    ``CostModel`` is the same-named scoring setting (declared once, copied by name)."""
    return copy_fields(KvConfig, s, weights=copy_fields(ScoringWeights, s),
                       costs=copy_fields(CostModel, s),
                       outlook=copy_fields(OutlookSettings, s))  # fmt: skip


T = TypeVar("T")


def copy_fields(cls: type[T], source: object, **given: Any) -> T:
    """A ``cls`` (a dataclass) whose fields not in ``given`` come from ``source`` by name.

    From an object every field must exist (``AttributeError``: a knob the settings lack is
    never silently defaulted); from a mapping, fields it lacks keep ``cls``'s defaults."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in given]  # type: ignore[arg-type]
    if isinstance(source, Mapping):
        values = {name: source[name] for name in names if name in source}
    else:
        values = {name: getattr(source, name) for name in names}
    return cls(**values, **given)


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
    if svc.peers is not None:
        svc.peers.attach(policy.outlook)
    ctx.metrics.kv.bind_state(_MemberRows(policy, replicas))
    # A replica that left, joined anew or restarted starts from nothing learnt.
    replicas.on_membership(lambda _change, replica: policy.forget(replica))
    svc.resets.listen(policy.forget)
    return policy


class _MemberRows:
    """The policy's gauge rows, for member replicas only (a replica that left has no
    series)."""

    def __init__(self, policy: KvPolicy, replicas: ReplicaRegistry) -> None:
        self._policy = policy
        self._replicas = replicas

    def gauge_rows(self) -> Iterator[tuple[str, str, float]]:
        members = self._replicas
        return (row for row in self._policy.gauge_rows() if row[1] in members)


def session_factory(ctx: PolicyContext) -> SessionPolicy:
    """Build the ``session`` policy."""
    from router.affinity import AffinityRing

    s = ctx.settings.scoring
    return SessionPolicy(ring=AffinityRing(vnodes=s.affinity_vnodes), metrics=ctx.metrics.kv,
                         clock=ctx.clock)
