"""The replay's discrete-event loop: requests, routing decisions and engine steps in
simulated seconds.

Events, in time order (ties in the order they were queued, so a run is deterministic):

* **arrival** of a turn: the policy under test decides (``Policy.route``, the code the
  router runs), the router's load tracker takes a lease exactly as the proxy does (the
  decision's prefill tokens, or the prompt length for policies that give none), and
  the request joins the chosen replica's waiting queue.  A prompt plus reply longer
  than the replica's context is rejected, as the replica's HTTP server would.
* **step end** of a replica: the scheduler applies the step; its KV events reach the
  index (``kvroute.replay.replica``) and feed the eviction-horizon estimator's allocation count
  as the event observer does in production; a first token moves the lease to decoding;
  a finished request returns the lease, hands the policy its receipt
  (``Policy.record``: cached tokens as the replica reports them) and schedules the
  session's next turn ``think_s`` later.  Then the replica plans its next step.
* **scrape** of every replica every ``scrape.interval_s``: the pool size and usage the
  ``/metrics`` scrape would show, into the horizon estimator.

The replicas' pool events also count the fleet's copies of blocks
(``kvroute.replay.copies``; ``replay_run``).

The router's clocks are the simulated clock: time-based judgements (provisional TTL,
placement decay, horizon) run at time scale 1 whatever the replay's speed.  With one
router (the default) the scrape's foreign load is always zero and is not modelled.
With ``ReplayConfig.routers`` N > 1, N policy objects of the same kind route, each
request by one of them drawn at random (seeded), as ``kvroute serve --workers N`` or N
routers on one index do: each has its own session table, load tracker, provisional
entries and horizon estimator (fed the same allocations and scrapes), and all read the
one index.  Each knows its own requests in flight, and of the others' what the scrapes
show, as in production: every ``scrape.interval_s`` each replica's waiting and running
requests (the scheduler's queues) reach every router, which counts what exceeds its
own as foreign load (``router.scoring.foreign_load``).  ``kv`` routers also tell each
other what their look ahead learns (requests routed and finished: pins, paused
conversations, service times), as the workers of ``kvroute serve --workers N`` do
and routers on one Redis index do (``router.outlook_peers``), unless
``ReplayConfig.shared_outlook`` is false (routers that share only the index:
``index.share_outlook: false``).  With one router the scrape's load is not modelled (it
would be the router's own).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from index.memory import InMemoryIndex
from kvkeys.types import ReplicaId
from kvroute.replay.copies import BlockCopies
from kvroute.replay.replica import VirtualReplica
from kvroute.replay.requests import ReplayRequest
from prompt.keyer import Prompt
from replica.sim.profiles import get_profile
from replica.sim.scheduler import SimRequest
from router.affinity import AffinityRing
from router.config import ScoringSettings
from router.fleet_outlook import FleetOutlook
from router.horizon import HorizonEstimator, PoolSample
from router.kv_policy import KvPolicy
from router.kv_services import kv_config
from router.load import Lease, LoadTracker
from router.load_policies import LeastLoaded, RoundRobin
from router.policy import Decision, Policy, Receipt, RouteRequest
from router.provisional import ProvisionalBlocks
from router.receipts import ReceiptCalibration
from router.scrape import LatestSamples, ScrapeSample
from router.session_policy import SessionPolicy
from router.session_table import SessionTable

__all__ = ["POLICIES", "ReplayConfig", "ReplayRun", "Served", "replay", "replay_run"]

POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "session", "kv")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The fleet and the router's settings for one replay."""

    replicas: int = 4
    num_blocks: int = 2048
    """KV blocks per replica, the null block included (as ``kvroute sim --num-blocks``)."""
    block_size: int = 16
    profile: str = "llama-3.1-8b-h100"
    model: str = "replay-model"
    scoring: ScoringSettings = field(default_factory=ScoringSettings)
    """The router's scoring settings; the replay sets the hardware figures
    (``prefill_tokens_per_s``, ``kv_bytes_per_token``) from the profile, as an operator
    configures them for the GPUs they run."""
    vocab_size: int = 2000
    seed: int = 0
    routers: int = 1
    """Router processes in front of the fleet (``kvroute serve --workers N``, or several
    routers on one index): each has its own policy state (session table, load view,
    provisional entries, horizon estimates) and every request goes to one of them drawn
    at random (seeded by ``seed`` and ``naming``), as the kernel deals a new connection
    to one of the workers.
    They share the index, which each fills from every replica's events."""
    shared_outlook: bool = True
    """With several ``kv`` routers, each tells the others of its requests as they are
    routed and finish, so every router's look ahead sees the whole fleet's, as
    ``kvroute serve --workers N``'s workers do (``router.outlook_peers``; here delivered
    at once).  ``False``: routers that share only the index and the scrapes (several
    ``kvroute serve`` on one Redis index)."""
    naming: int = 0
    """Which names the replicas get: 0 names them ``r0`` to ``rN-1``, another value
    another set of names.  Consistent-hash rings (the session policy's pins, the kv
    policy's tie order) place sessions by name, so a policy's figures over several
    namings tell its own effect from one hash assignment's luck (``replica_ids``)."""

    def replica_ids(self) -> list[ReplicaId]:
        """The replicas' ids under ``naming``."""
        suffix = "" if self.naming == 0 else f".{self.naming}"
        return [ReplicaId(f"r{i}{suffix}") for i in range(self.replicas)]

    def settings(self) -> ScoringSettings:
        """``scoring`` with the profile's hardware figures."""
        p = get_profile(self.profile)
        return self.scoring.model_copy(update={
            "prefill_tokens_per_s": 1.0 / p.prefill_s_per_token,
            "kv_bytes_per_token": float(p.kv_bytes_per_token),
        })


@dataclass(frozen=True, slots=True)
class Served:
    """What happened to one request."""

    session: str
    turn: int
    arrival_s: float
    prompt_tokens: int
    replica: str | None
    reason: str | None
    cached_tokens: int = 0
    predicted_cached_tokens: int | None = None
    ttft_s: float | None = None
    previous_replica: str | None = None
    """The replica of the session's previous turn (``None`` for turn 1)."""
    error: str | None = None
    router: int = 0
    """Which router routed it (``ReplayConfig.routers``)."""

    @property
    def ok(self) -> bool:
        """Served without error."""
        return self.error is None


class _PeerFeed:
    """``OutlookFeed`` to the other routers' look aheads, delivered at once (as
    ``router.outlook_peers`` delivers them between workers, in well under a
    millisecond)."""

    def __init__(self, peers: list[FleetOutlook], clock: Callable[[], float]) -> None:
        self._peers = peers
        self._clock = clock

    def routed(self, request_id: str, session: str | None, replica: ReplicaId,
               blocks: float, think_s: float | None) -> None:
        for peer in self._peers:
            peer.peer_routed(request_id, session, replica, blocks, think_s, self._clock())

    def finished(self, request_id: str, session: str | None, replica: ReplicaId,
                 released: int | None, ttft_s: float | None,
                 reply_tokens: int | None) -> None:
        for peer in self._peers:
            peer.peer_finished(request_id, session, replica, released, ttft_s, reply_tokens,
                               self._clock())


class _Prompts:
    """``PromptSource`` for the kv policy: the prompt registered for the request id."""

    def __init__(self) -> None:
        self.by_id: dict[str, Prompt] = {}

    async def prompt(self, request: RouteRequest, replica_url: str | None) -> Prompt | None:
        return self.by_id.get(request.request_id)


@dataclass(slots=True)
class _Pending:
    req: ReplayRequest
    route: RouteRequest
    decision: Decision
    lease: Lease
    replica: VirtualReplica
    arrival: float
    previous: ReplicaId | None
    router: int = 0
    """Which of the routers routed it (and records it)."""
    first: float | None = None


def _make_policy(
    name: str, s: ScoringSettings, load: LoadTracker, index: InMemoryIndex,
    prompts: _Prompts, reps: dict[ReplicaId, VirtualReplica], clock: Callable[[], float],
    seed: int, scrapes: LatestSamples | None = None,
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(load)
    if name == "session":
        return SessionPolicy(ring=AffinityRing(vnodes=s.affinity_vnodes), clock=clock)
    if name != "kv":
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return KvPolicy(
        prompts=prompts, index=index, load=load, replica_url=lambda r: None,
        statuses=lambda r: reps[r].status() if r in reps else None,
        horizon=HorizonEstimator(tau_s=s.horizon_tau_s, stale_s=3 * s.scrape.stale_after_s),
        config=kv_config(s), ring=AffinityRing(vnodes=s.affinity_vnodes),
        provisional=ProvisionalBlocks(ttl_s=s.provisional_ttl_s, max_keys=s.provisional_max_keys),
        sessions=SessionTable(max_sessions=s.max_sessions, max_token_bytes=s.session_token_bytes),
        calibration=ReceiptCalibration(weight=s.receipt_trust_weight,
                                       floor=s.receipt_trust_floor),
        clock=clock, wall=clock, rng=random.Random(seed), scraper=scrapes,
    )


class _Replay:
    """One run: the state of the loop (see the module docstring)."""

    def __init__(self, policy: str, cfg: ReplayConfig) -> None:
        s = cfg.settings()
        self.cfg = cfg
        self.now = 0.0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        index = InMemoryIndex()
        vocab = list(range(1, cfg.vocab_size + 1))
        profile = get_profile(cfg.profile)
        self.copies = BlockCopies()
        self.reps = {
            r: VirtualReplica(r, model=cfg.model, profile=profile, num_blocks=cfg.num_blocks,
                              block_size=cfg.block_size, vocab=vocab, index=index, seed=i,
                              copies=self.copies)
            for i, r in enumerate(cfg.replica_ids())
        }
        self.candidates = list(self.reps)
        self.prompts = _Prompts()
        if cfg.routers < 1:
            raise ValueError("a replay needs at least one router")
        self.loads = [LoadTracker(self.candidates) for _ in range(cfg.routers)]
        # With several routers each learns of the others' queues from the scrapes.
        self.scrapes = (LatestSamples(s.scrape.stale_after_s) if cfg.routers > 1
                        else None)
        self.policies = [
            _make_policy(policy, s, load, index, self.prompts, self.reps, lambda: self.now,
                         cfg.seed + k, self.scrapes)
            for k, load in enumerate(self.loads)]
        self.horizons = [p.horizon for p in self.policies if isinstance(p, KvPolicy)]
        kv = [p for p in self.policies if isinstance(p, KvPolicy)]
        if len(kv) > 1 and cfg.shared_outlook:
            for one in kv:
                one.outlook.feed = _PeerFeed([q.outlook for q in kv if q is not one],
                                             lambda: self.now)
        self.dealer = random.Random(f"routers {cfg.seed} {cfg.naming}")
        self.scrape_s = s.scrape.interval_s
        self.pending: dict[str, _Pending] = {}
        self.last_replica: dict[str, ReplicaId] = {}
        self.results: list[Served] = []
        self.turns: dict[str, list[ReplayRequest]] = {}
        self.serial = itertools.count()

    def push(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, data))

    async def run(self, requests: Sequence[ReplayRequest]) -> list[Served]:
        for r in sorted(requests, key=lambda r: (r.session, r.turn)):
            self.turns.setdefault(r.session, []).append(r)
        for turns in self.turns.values():
            turns.reverse()  # pop() takes the next turn
            first = turns.pop()
            self.push(first.at, 1, first)
        if self.horizons or self.scrapes is not None:
            self.push(0.0, 2, None)
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            self.now = t
            if kind == 0:
                await self._step_end(data)
            elif kind == 1:
                await self._arrive(data)
            elif self.pending or any(self.turns.values()):
                self._scrape()
                self.push(t + self.scrape_s, 2, None)
        return self.results

    def _scrape(self) -> None:
        for r, rep in self.reps.items():
            pool = rep.pool
            sample = PoolSample(
                t=self.now, block_size=pool.block_size, num_gpu_blocks=pool.num_blocks - 1,
                kv_usage=pool.usage(), computed_prompt_tokens_total=None,
                generation_tokens_total=None)
            for horizon in self.horizons:
                horizon.observe_scrape(r, sample, count_allocations=False)
            if self.scrapes is not None:
                scheduler = rep.scheduler
                self.scrapes.observe(r, ScrapeSample(
                    t=self.now, waiting=float(len(scheduler.waiting)),
                    running=float(len(scheduler.running))))

    def _next_turn(self, session: str, after: float) -> None:
        turns = self.turns.get(session)
        if turns:
            nxt = turns.pop()
            self.push(after + nxt.think_s, 1, nxt)

    async def _arrive(self, req: ReplayRequest) -> None:
        cfg = self.cfg
        n = len(req.tokens)
        rid = f"{req.session}/{req.turn}"
        previous = self.last_replica.get(req.session) if req.turn > 1 else None
        limit = next(iter(self.reps.values())).max_model_len
        if n + req.max_tokens > limit:
            self.results.append(Served(req.session, req.turn, self.now, n, None, None,
                                       previous_replica=previous, error="too_long"))
            self._next_turn(req.session, self.now)
            return
        tokens = list(req.tokens)
        rep0 = next(iter(self.reps.values()))
        keys = rep0.keys(tokens, req.cache_salt)
        self.prompts.by_id[rid] = Prompt(token_ids=tokens, block_keys=list(keys),
                                         block_size=cfg.block_size, model=cfg.model,
                                         cache_salt=req.cache_salt)
        body = {"model": cfg.model, "messages": [{"role": "user", "content": rid}]}
        route = RouteRequest(request_id=rid, endpoint="chat", path="/v1/chat/completions",
                             model=cfg.model, body=body, session_key=req.session)
        router = self.dealer.randrange(self.cfg.routers) if self.cfg.routers > 1 else 0
        decision = await self.policies[router].route(route, self.candidates)
        self.prompts.by_id.pop(rid, None)
        rep = self.reps[decision.replica]
        charge = decision.prompt_tokens if decision.prompt_tokens is not None else n
        lease = self.loads[router].lease(rep.id, charge)
        lease.__enter__()
        sim = SimRequest(rid, tokens, req.max_tokens, keys=list(keys),
                         cache_salt=req.cache_salt, seed=next(self.serial))
        self.pending[rid] = _Pending(req, route, decision, lease, rep, self.now, previous,
                                     router)
        self.last_replica[req.session] = rep.id
        rep.add(sim, self.now)
        self._kick(rep)

    def _kick(self, rep: VirtualReplica) -> None:
        end = rep.start_step(self.now)
        if end is not None:
            self.push(end, 0, rep)

    async def _step_end(self, rep: VirtualReplica) -> None:
        outputs, stored = await rep.finish_step(self.now)
        if stored:
            for horizon in self.horizons:
                horizon.observe_allocated(rep.id, self.now, stored)
        for sim in outputs:
            p = self.pending.get(sim.request_id)
            if p is None:
                continue
            if p.first is None and sim.first_token_s is not None:
                p.first = sim.first_token_s
                p.lease.first_byte()
            if sim.finished:
                self._finish(p, sim)
        self._kick(rep)

    def _finish(self, p: _Pending, sim: SimRequest) -> None:
        del self.pending[sim.request_id]
        p.lease.release()
        ttft = None if p.first is None else p.first - p.arrival
        cached = max(0, sim.num_cached_tokens)
        self.policies[p.router].record(p.route, p.decision, Receipt(
            replica=p.replica.id, ok=True, prompt_tokens=sim.num_prompt, cached_tokens=cached,
            ttfb_s=ttft, completion_tokens=sim.num_output))
        self.results.append(Served(
            session=p.req.session, turn=p.req.turn, arrival_s=p.arrival,
            prompt_tokens=sim.num_prompt, replica=p.replica.id, reason=p.decision.reason,
            cached_tokens=cached, predicted_cached_tokens=p.decision.predicted_cached_tokens,
            ttft_s=ttft, previous_replica=p.previous, router=p.router,
        ))
        self._next_turn(p.req.session, self.now)


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """One replay: what happened to each request, and what the fleet's caches held."""

    served: list[Served]
    """One per request, in completion order."""
    mean_copies: float
    """Blocks the fleet's pools held that another block of the fleet also held,
    averaged over simulated time (``kvroute.replay.copies``)."""


async def replay_run(
    policy: str, requests: Sequence[ReplayRequest], cfg: ReplayConfig
) -> ReplayRun:
    """Replay ``requests`` through ``policy`` on a fresh fleet."""
    run = _Replay(policy, cfg)
    served = await run.run(requests)
    return ReplayRun(served, run.copies.mean_copies())


async def replay(
    policy: str, requests: Sequence[ReplayRequest], cfg: ReplayConfig
) -> list[Served]:
    """Replay ``requests`` through ``policy`` on a fresh fleet; one ``Served`` per
    request, in completion order."""
    return (await replay_run(policy, requests, cfg)).served
