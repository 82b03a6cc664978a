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

``RegistryPrompts`` adapts the renderer registry to the policy's ``PromptSource``: a
request that cannot be rendered exactly (``RenderError`` of any kind) has no prompt, and
the policy falls back to affinity; the replica still gets the request and answers for
itself (a malformed request is the replica's 400 to give, not the router's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from aio.cancel import cancel_and_wait
from index.event_applier import BatchResult
from index.ingestion import KVEventIngestion, SourceSpec
from index.status import SourceStatus
from index.store import KVIndex
from kvkeys.types import ReplicaId
from prompt.errors import RenderError
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer
from router.config import ScoringSettings
from router.horizon import HorizonEstimator, PoolSample
from router.kv_policy import KvConfig, KvPolicy
from router.kv_stack import KvStack, open_kv_stack, source_specs
from router.plugins import PolicyContext, Service
from router.policy import RouteRequest
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
    return [copy_fields(ModelSpec, m.model_dump(), loras=tuple(m.loras)) for m in s.models]


@asynccontextmanager
async def start_kv(ctx: PolicyContext) -> AsyncIterator[KvServices]:
    """Build renderers, the KV stack and the scraper (see the module docstring)."""
    s = ctx.settings.scoring
    remote = RemoteRenderer(ctx.http, timeout_s=s.remote_render_timeout_s)
    registry = RendererRegistry(_model_specs(s), remote=remote)
    horizon = HorizonEstimator(tau_s=s.horizon_tau_s, stale_s=3 * s.scrape.stale_after_s)
    replicas = ctx.replicas
    opened: KvStack | None = None
    scraper: MetricsScraper | None = None

    def block_size_hint() -> int | None:
        """The block size the replicas report (scrape first, then KV events)."""
        now = ctx.clock()
        for state in replicas.all():
            sample = scraper.latest(state.id, now) if scraper is not None else None
            if sample is not None and sample.block_size:
                return sample.block_size
            status = opened.status(state.id) if opened is not None else None
            if status is not None and status.block_size:
                return status.block_size
        return None

    prompts = RegistryPrompts(registry, remote=s.remote_render,
                              block_size_hint=block_size_hint if s.auto_models else None)
    specs = source_specs(ctx.settings, lambda r: replicas[r].models)
    async with open_kv_stack(
        ctx.settings, ctx.metrics.registry, http=ctx.http, specs=specs,
        observer=_HorizonObserver(horizon, ctx),
        gauge_replicas=lambda: [ReplicaId(st.id) for st in replicas.all()],
    ) as stack:  # fmt: skip
        opened, ingestion = stack, stack.ingestion
        if ingestion is not None and ctx.settings.policy == "kv":
            await _await_live(ingestion, stack.specs, s.startup_sync_s)
        task: asyncio.Task[Any] | None = None
        if s.scrape.enabled:
            scraper = MetricsScraper(
                ctx.http, lambda: [(st.id, st.url) for st in replicas.all()],
                clock=ctx.clock, interval_s=s.scrape.interval_s, timeout_s=s.scrape.timeout_s,
                stale_after_s=s.scrape.stale_after_s,
            )
            scraper.add_listener(_pool_listener(horizon, lambda: ingestion))
            task = ctx.tasks.spawn(scraper.run(), name="kv-scrape")
        try:
            yield KvServices(prompts, stack.index, horizon, scraper, ingestion)
        finally:
            # Stop the scraper with the stack, not after every service has exited; a
            # failure it ended with was logged by the task owner already.
            if task is not None:
                with contextlib.suppress(Exception):
                    await cancel_and_wait(task)


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
    """The ``kv`` service for ``router.builtin_plugins.builtin_services``."""
    return Service("kv", start_kv)


def kv_config(s: ScoringSettings) -> KvConfig:
    """The policy's numbers: every field of ``KvConfig``, ``ScoringWeights`` and
    ``CostModel`` is the same-named scoring setting (declared once, copied by name)."""
    return copy_fields(KvConfig, s, weights=copy_fields(ScoringWeights, s),
                       costs=copy_fields(CostModel, s))  # fmt: skip


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
    ctx.metrics.kv.bind_state(policy)
    return policy


def session_factory(ctx: PolicyContext) -> SessionPolicy:
    """Build the ``session`` policy."""
    from router.affinity import AffinityRing

    s = ctx.settings.scoring
    return SessionPolicy(ring=AffinityRing(vnodes=s.affinity_vnodes), metrics=ctx.metrics.kv,
                         clock=ctx.clock)
