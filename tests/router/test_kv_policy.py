"""The kv policy's pipeline with real parts: the tiny tokenizer rendered by ``index``'s
registry, the in-memory index, the router's load tracker, Prometheus metrics."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.status import SourceStatus
from kvkeys.types import EngineKey, Medium, ReplicaId
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from replica.vllm.tiny_tokenizer import build_tokenizer
from router.affinity import AffinityKey
from router.horizon import PoolSample
from router.kv_policy import KvConfig, KvPolicy
from router.kv_services import RegistryPrompts
from router.load import LoadTracker
from router.metrics import KvMetrics
from router.policy import Receipt, RouteRequest
from router.scoring import ScoringWeights
from tests.ports import free_port

MODEL = "tiny"
R = [ReplicaId(f"r{i}") for i in range(4)]
SYSTEM = "You are a helpful assistant. " + " ".join(f"rule{i} applies here" for i in range(60))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> RendererRegistry:
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")
    return RendererRegistry([ModelSpec(name=MODEL, block_size=16, tokenizer=str(tok))])


class Env:
    def __init__(self, registry: RendererRegistry, **kw: Any) -> None:
        self.index = kw.pop("index", None) or InMemoryIndex()
        self.load = LoadTracker(R)
        self.prom = CollectorRegistry()
        self.metrics = KvMetrics(self.prom)
        self.clock = Clock()
        self.prompts = RegistryPrompts(registry, remote=False)
        self.policy = KvPolicy(
            prompts=self.prompts, index=self.index, load=self.load,
            replica_url=lambda r: None, metrics=self.metrics, clock=self.clock,
            wall=self.clock, **kw,
        )

    async def prompt(self, req: RouteRequest) -> Prompt:
        p = await self.prompts.prompt(req, None)
        assert p is not None
        return p

    async def hold(self, replica: ReplicaId, req: RouteRequest, blocks: int | None = None,
                   medium: Medium = Medium.GPU) -> None:
        keys = (await self.prompt(req)).block_keys[:blocks]
        await self.index.add(replica, [EngineKey(k) for k in keys], keys, medium)

    def value(self, name: str, **labels: str) -> float:
        v = self.prom.get_sample_value(name, labels)
        return 0.0 if v is None else v


def chat(*turns: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
             for i, t in enumerate(turns)]
    return {"model": MODEL, "messages": msgs, **extra}


def req(body: dict[str, Any], session: str | None = None, rid: str = "q") -> RouteRequest:
    return RouteRequest(rid, "chat", "/v1/chat/completions", MODEL, body, session)


async def test_routes_to_the_replica_holding_the_prompt(registry: RendererRegistry) -> None:
    env = Env(registry)
    first = req(chat("tell me about blocks"))
    await env.hold(R[2], first)
    later = req(chat("tell me about blocks", "they are 16 tokens", "and then?"))
    prompt = await env.prompt(later)
    d = await env.policy.route(later, R)
    assert d.replica == R[2] and d.reason == "kv_hit" and d.want_usage
    held = len((await env.prompt(first)).block_keys)
    assert d.predicted_cached_tokens == prompt.expected_cached_tokens(held) == held * 16
    assert d.prompt_tokens == prompt.num_tokens - held * 16  # what the lease charges
    assert d.detail["prompt_tokens"] == prompt.num_tokens
    assert env.value("router_kv_predicted_cached_tokens_total", replica="r2") == held * 16


async def test_salted_tenants_never_match_each_other(registry: RendererRegistry) -> None:
    env = Env(registry)
    body_a = chat("same question", cache_salt="tenant-a")
    await env.hold(R[1], req(body_a))
    a = await env.policy.route(req(chat("same question", "x", "y", cache_salt="tenant-a")), R)
    b_req = req(chat("same question", "x", "y", cache_salt="tenant-b"))
    b = await env.policy.decide(b_req, R, commit=False)
    unsalted = await env.policy.decide(req(chat("same question", "x", "y")), R, commit=False)
    assert a.replica == R[1] and a.reason == "kv_hit" and a.predicted_cached_tokens
    assert b.reason == "affinity_no_hit" and b.predicted_cached_tokens == 0
    assert unsalted.reason == "affinity_no_hit" and unsalted.predicted_cached_tokens == 0


async def test_shared_system_prompt_everywhere_spreads_new_conversations(
    registry: RendererRegistry,
) -> None:
    env = Env(registry)
    shared = req(chat("warm up"))
    for r in R:
        await env.hold(r, shared, blocks=len((await env.prompt(shared)).block_keys) - 1)
    placed: collections.Counter[ReplicaId] = collections.Counter()
    for u in range(40):  # paced: nothing in flight at decision time
        d = await env.policy.route(req(chat(f"user {u} asks something new")), R)
        # Only the prefix every replica holds was there to find: its own label.
        assert d.reason == "kv_shared" and (d.predicted_cached_tokens or 0) > 200
        placed[d.replica] += 1
        env.clock.t += 60  # provisional entries expire between users
    assert set(placed) == set(R) and max(placed.values()) <= 20, placed


async def test_paced_new_conversations_do_not_pile_onto_one_prefix_holder(
    registry: RendererRegistry,
) -> None:
    # one replica holds a long shared system prompt and nothing is ever in flight:
    # the recent-placements term replicates the prefix instead of a 40/0/0/0 hotspot
    env = Env(registry)
    system = "Shared agent rules. " + " ".join(f"rule{i} is binding" for i in range(300))
    first = req(chat("warm", system=system))
    await env.hold(R[0], first)
    shared_tokens = len((await env.prompt(first)).block_keys) * 16
    placed: collections.Counter[ReplicaId] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    for u in range(40):
        d = await env.policy.route(req(chat(f"user {u} has a question", system=system)), R)
        placed[d.replica] += 1
        reasons[d.reason] += 1
        await env.hold(d.replica, first)  # what its events would tell the index
        env.clock.t += 2.0
    assert shared_tokens > 1000
    assert set(placed) == set(R) and max(placed.values()) <= 16, placed
    assert reasons["kv_load"] >= 3  # the prefix was computed again on purpose


async def test_shared_prefix_with_load_goes_to_the_least_loaded(
    registry: RendererRegistry,
) -> None:
    env = Env(registry)
    shared = req(chat("warm up"))
    for r in R:
        await env.hold(r, shared, blocks=20)
    leases = [env.load.lease(r, 3000) for r in (R[0], R[1], R[3])]
    for lease in leases:
        await lease.__aenter__()
    d = await env.policy.route(req(chat("a new user")), R)
    assert d.replica == R[2]
    for lease in leases:
        lease.release()


async def test_overloaded_holder_replicates_a_popular_prefix(registry: RendererRegistry) -> None:
    env = Env(registry)
    hot = req(chat("the popular question"))
    await env.hold(R[0], hot)
    n_cached = len((await env.prompt(hot)).block_keys) * 16
    d1 = await env.policy.decide(req(chat("the popular question", "a", "b")), R, commit=False)
    assert d1.replica == R[0] and d1.reason == "kv_hit"
    # the holder's queue grows past what the prefix saves: the next one computes it
    # elsewhere (reason kv_load), and provisional entries make the copy visible
    lease = env.load.lease(R[0], n_cached + 500)
    await lease.__aenter__()
    d2 = await env.policy.route(req(chat("the popular question", "c", "d")), R)
    assert d2.replica != R[0] and d2.reason == "kv_load"
    d3 = await env.policy.decide(req(chat("the popular question", "e", "f")), R, commit=False)
    assert d3.replica == d2.replica and d3.reason == "kv_hit"
    lease.release()


async def test_burst_with_a_new_prefix_goes_together(registry: RendererRegistry) -> None:
    env = Env(registry)
    # an agent's fan-out: a new 2k-token prompt, sub-calls arriving within milliseconds
    new_system = "A brand new agent prompt. " + " ".join(f"tool{i} does x" for i in range(400))
    first = await env.policy.route(req(chat("sub-task 0", system=new_system)), R)
    assert first.reason == "affinity_no_hit"
    for i in range(1, 4):  # new conversations each: the placement term allows ~3 here
        env.clock.t += 0.01
        d = await env.policy.route(req(chat(f"sub-task {i}", system=new_system)), R)
        assert d.replica == first.replica and d.reason == "kv_hit"
    # sub-calls of one agent session all go together, however many
    for i in range(10):
        env.clock.t += 0.01
        d = await env.policy.route(
            req(chat(f"agent step {i}", system=new_system), session="agent-7"), R)
        assert d.replica == first.replica and d.reason == "kv_hit"
    env.clock.t += 30  # provisional entries expired, no events came: back to affinity
    late = await env.policy.decide(req(chat("sub-task 9", system=new_system)), R, commit=False)
    assert late.reason == "affinity_no_hit"


async def test_index_down_falls_back_to_affinity(registry: RendererRegistry) -> None:
    down = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.05)
    try:
        env = Env(registry, index=down)
        body = chat("hello there")
        d1 = await env.policy.route(req(body, session="s1"), R)
        d2 = await env.policy.route(req(chat("hello there", "a", "b"), session="s1"), R)
    finally:
        await down.aclose()
    assert d1.reason == d2.reason == "affinity_index_down"
    assert d1.replica == d2.replica == env.policy.ring.first("s1", R)
    assert d1.predicted_cached_tokens is None
    assert env.value("router_kv_fallbacks_total", cause="index_down") == 2


async def test_no_index_no_prompt_and_overload_escape(registry: RendererRegistry) -> None:
    env = Env(registry)
    other = RouteRequest("o", "other", "/v1/embeddings", MODEL, {"input": "x"}, "sess")
    d = await env.policy.route(other, R)
    assert d.reason == "affinity_no_prompt" and d.replica == env.policy.ring.first("sess", R)
    unknown = req({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert (await env.policy.route(unknown, R)).reason == "affinity_no_prompt"
    pinned = env.policy.ring.first("heavy", R)
    lease = env.load.lease(pinned, 50_000)
    await lease.__aenter__()
    d = await env.policy.route(req(chat("hi"), session="heavy"), R)
    assert d.reason == "affinity_overload" and d.replica != pinned
    lease.release()


async def test_cpu_blocks_are_discounted_but_still_attract(registry: RendererRegistry) -> None:
    env = Env(registry)
    r = req(chat("offloaded conversation", "x", "y"))
    await env.hold(R[3], req(chat("offloaded conversation")), medium=Medium.CPU)
    d = await env.policy.decide(r, R, commit=False)
    assert d.replica == R[3]
    row = d.detail["replicas"][0]
    assert row["cpu_blocks"] > 0 and row["gpu_blocks"] == 0
    assert 0 < row["expected_cached_tokens"] < row["predicted_cached_tokens"]


async def test_stale_index_lowers_the_hit_probability(registry: RendererRegistry) -> None:
    clock_wall = 1000.0
    statuses = {
        R[0]: SourceStatus(R[0], MODEL, None, state="degraded", connected=False,
                           last_receive_wall=clock_wall - 5.0),
        R[1]: SourceStatus(R[1], MODEL, None, state="live", connected=True, receive_lag_s=0.01),
    }
    env = Env(registry, statuses=statuses.get)
    body = req(chat("question", "a", "b"))
    for r in R[:2]:
        await env.hold(r, req(chat("question")))
    d = await env.policy.decide(body, R, commit=False)
    rows = {row["replica"]: row for row in d.detail["replicas"]}
    assert rows["r0"]["p_index"] == 0.5 and rows["r1"]["p_index"] == 1.0
    assert d.replica == R[1]


async def test_receipts_prediction_error_and_calibration(registry: RendererRegistry) -> None:
    env = Env(registry, config=KvConfig(weights=ScoringWeights()))
    r = req(chat("receipts please", "a", "b"))
    await env.hold(R[1], req(chat("receipts please")))
    d = await env.policy.route(r, R)
    predicted = d.predicted_cached_tokens
    assert predicted
    env.policy.record(r, d, Receipt(R[1], True, prompt_tokens=500, cached_tokens=predicted))
    env.policy.record(r, d, Receipt(R[1], True, prompt_tokens=500, cached_tokens=0))
    env.policy.record(r, d, Receipt(R[1], True, prompt_tokens=500, cached_tokens=None))
    env.policy.record(r, d, Receipt(R[2], True, prompt_tokens=500, cached_tokens=0))  # failover
    assert env.value("router_receipts_total", replica="r1", outcome="match") == 1
    assert env.value("router_receipts_total", replica="r1", outcome="over") == 1
    assert env.value("router_receipts_total", replica="r1", outcome="missing") == 1
    assert env.value("router_kv_prediction_disagreements_total", replica="r1",
                     direction="over") == 1
    assert env.value("router_kv_prediction_error_tokens_bucket", replica="r1", le="0.0") == 2
    assert env.value("router_kv_prediction_error_tokens_bucket", replica="r1", le="-1.0") == 1
    assert env.value("router_receipt_prompt_tokens_total", replica="r1",
                     kind="cached") == predicted
    assert env.policy.calibration.trust(R[1]) < 1.0


async def test_sessions_stickiness_think_time_and_prefix_breaks(
    registry: RendererRegistry,
) -> None:
    env = Env(registry)
    t1 = req(chat("first question"), session="alice")
    d1 = await env.policy.route(t1, R)
    env.clock.t += 1.0
    env.policy.record(t1, d1, Receipt(d1.replica, True, 100, 0))
    await env.hold(d1.replica, t1)
    env.clock.t += 12.0
    t2 = req(chat("first question", "an answer", "second question"), session="alice")
    d2 = await env.policy.route(t2, R)
    assert d2.replica == d1.replica
    assert env.value("router_session_turns_total", policy="kv", placement="same_replica") == 1
    assert env.value("router_session_think_time_seconds_count") == 1
    assert env.value("router_session_think_time_seconds_sum") == pytest.approx(12.0)
    assert env.value("router_session_returns_total", replica=d1.replica, outcome="unknown") == 1
    assert env.value("router_prefix_breaks_total", cause="message_edited") == 0
    # turn 3 rewrites the system prompt (a timestamp): a prefix break at the system message
    t3 = req(chat("first question", "an answer", "second question", "x", "third",
                  system=SYSTEM.replace("helpful", "useful")), session="alice")
    await env.policy.route(t3, R)
    assert env.value("router_prefix_breaks_total", cause="message_edited") == 1
    assert env.value("router_prefix_break_lost_tokens_total") > 0


async def test_dry_run_changes_nothing(registry: RendererRegistry) -> None:
    env = Env(registry)
    r = req(chat("dry"), session="s")
    d = await env.policy.decide(r, R, commit=False)
    assert len(env.policy.provisional) == 0 and len(env.policy.sessions) == 0
    assert d.detail["replicas"][0]["replica"] == d.replica
    assert {row["replica"] for row in d.detail["replicas"]} == set(R)
    await env.policy.route(r, R)
    assert len(env.policy.provisional) > 0 and len(env.policy.sessions) == 1


async def test_gauge_rows_report_load_terms(registry: RendererRegistry) -> None:
    env = Env(registry)
    env.metrics.bind_state(env.policy)
    await env.policy.route(req(chat("x")), R)
    rows: Sequence[tuple[str, str, float]] = list(env.policy.gauge_rows())
    assert ("router_kv_index_trust", "r0", 1.0) in rows
    assert env.value("router_kv_load_queued_prefill_tokens", replica="r0") == 0
    assert env.value("router_route_seconds_count", policy="kv") == 1
    env.metrics.close()


async def test_the_pool_estimate_follows_the_policys_requests(
    registry: RendererRegistry,
) -> None:
    # A finished request returns its prompt and output blocks to the pool: the free pool
    # between two scrapes follows (a routed hit's blocks are not taken off: see
    # router.horizon).
    env = Env(registry)
    h = env.policy.horizon
    h.observe_scrape(R[1], PoolSample(env.clock.t, 16, 1000, 0.5, None, None),
                     count_allocations=False)
    r = req(chat("pool please", "a", "b"), session="pool")
    await env.hold(R[1], req(chat("pool please")))
    d = await env.policy.route(r, R)
    assert d.replica == R[1] and d.predicted_cached_tokens
    assert h.free_blocks(R[1], env.clock.t) == pytest.approx(500)
    env.policy.record(r, d, Receipt(R[1], True, prompt_tokens=330, cached_tokens=0,
                                    completion_tokens=20))
    assert h.free_blocks(R[1], env.clock.t) == pytest.approx(500 + 22)  # 350 / 16
    # the session's turn remembers the pool ahead of its blocks and its run's size
    state = env.policy.sessions.get("pool")
    assert state is not None and (state.free_mark, state.blocks_mark) == (500, 22)


async def test_a_move_counts_the_hit_it_gives_up(registry: RendererRegistry) -> None:
    env = Env(registry)
    t1 = req(chat("where is my cache"), session="s")
    d1 = await env.policy.route(t1, R)
    t2 = req(chat("where is my cache", "on one replica", "and now?"), session="s")
    await env.hold(d1.replica, t2)  # the first turn's blocks, as its events reported
    env.policy.record(t1, d1, Receipt(d1.replica, ok=True, prompt_tokens=500,
                                      cached_tokens=0, completion_tokens=5))
    env.clock.t += 60
    held = (await env.policy.decide(t2, R, commit=False)).predicted_cached_tokens or 0
    assert held > 200
    # A queue on the session's replica far beyond what its context saves: the turn
    # leaves, and the expected hit it left behind is counted for that replica.
    lease = env.load.lease(d1.replica, 100_000)
    await lease.__aenter__()
    d2 = await env.policy.route(t2, R)
    lease.release()
    assert d2.replica != d1.replica and d2.reason == "kv_load"
    given_up = env.value("router_kv_moved_given_up_tokens_total", replica=d1.replica)
    assert held - 16 <= given_up <= held
    # The next turn finds the new replica swamped too and goes back: the replica it had
    # left still holds the second turn's prompt, which is what the counter records.
    env.policy.record(t2, d2, Receipt(d2.replica, ok=True, prompt_tokens=800,
                                      cached_tokens=0, completion_tokens=5))
    env.clock.t += 60
    t3 = req(chat("where is my cache", "on one replica", "and now?", "back", "again"),
             session="s")
    lease = env.load.lease(d2.replica, 200_000)
    await lease.__aenter__()
    d3 = await env.policy.route(t3, R)
    lease.release()
    assert d3.replica == d1.replica
    assert env.value("router_kv_came_back_turns_total", replica=d1.replica) == 1
    assert env.value("router_kv_came_back_held_tokens_total", replica=d1.replica) == held


async def test_new_conversations_go_where_the_cache_is_lost_anyway(
    registry: RendererRegistry,
) -> None:
    # r3 churns its pool (100 blocks/s of 750 free: a 7.5 s eviction horizon), the
    # others barely (750 s).  A conversation came back to each after 30 s: within the
    # horizon on r0-r2 (their cache was reused), beyond it on r3 (lost).  With every
    # replica holding the shared prompt and no queue, a new conversation displaces
    # reusable context on r0-r2 but not on r3: it goes to r3.
    from router.horizon import HorizonEstimator

    def env_with_history(**kw: Any) -> Env:
        env = Env(registry, horizon=HorizonEstimator(tau_s=30.0, stale_s=1e9), **kw)
        for r in R:
            rate = 1600.0 if r == R[3] else 16.0
            for t, computed in ((0.0, 0.0), (1.0, rate)):
                env.policy.horizon.observe_scrape(r, PoolSample(
                    t=t, block_size=16, num_gpu_blocks=1000, kv_usage=0.25,
                    computed_prompt_tokens_total=computed, generation_tokens_total=0.0))
            tracker = env.policy.tracker
            akey = AffinityKey(f"s-{r}", "session")
            turn = req(chat("hello"), session=f"s-{r}")
            tracker.turn(turn, akey, r, None, 1.0)
            tracker.finished(f"s-{r}", r, 100, 1.0)  # a 100-block conversation
            tracker.turn(turn, akey, r, None, 31.0)
        return env

    async def first_choices(env: Env) -> set[ReplicaId]:
        shared = req(chat("warm up"))
        for r in R:
            await env.hold(r, shared, blocks=len((await env.prompt(shared)).block_keys) - 1)
        chosen = set()
        for u in range(8):
            d = await env.policy.decide(req(chat(f"user {u} asks"), session=f"u{u}"), R,
                                        commit=False)
            assert d.reason == "kv_shared"
            chosen.add(d.replica)
        return chosen

    assert await first_choices(env_with_history()) == {R[3]}
    unpriced = env_with_history(config=KvConfig(price_placements=False))
    assert len(await first_choices(unpriced)) > 1  # ring order spreads them


async def test_a_replica_that_left_or_restarted_starts_from_nothing_learnt(
    registry: RendererRegistry,
) -> None:
    # What the policy learnt of r1 (provisional blocks, the pool, receipt trust, the
    # paused conversation's run, the load view) describes an engine that is gone once
    # r1 leaves or restarts: forget drops it, and r2's stays.
    env = Env(registry)
    h = env.policy.horizon
    for replica in (R[1], R[2]):
        h.observe_scrape(replica, PoolSample(env.clock.t, 16, 1000, 0.5, None, None),
                         count_allocations=False)
    r = req(chat("forget me", "a", "b"), session="gone")
    await env.hold(R[1], req(chat("forget me")))
    d = await env.policy.route(r, R)
    assert d.replica == R[1]
    assert env.policy.provisional.run(R[1], (await env.prompt(r)).block_keys, env.clock.t)
    env.policy.record(r, d, Receipt(R[1], True, prompt_tokens=330, cached_tokens=0,
                                    completion_tokens=20))
    outlook = env.policy.outlook
    assert outlook.idle_runs.replica_of("gone") == R[1]
    assert env.policy.calibration.trust(R[1]) < 1.0
    assert h.free_blocks(R[1], env.clock.t) is not None

    env.policy.forget(R[1])
    assert not env.policy.provisional.run(R[1], (await env.prompt(r)).block_keys,
                                          env.clock.t)
    assert outlook.idle_runs.replica_of("gone") is None
    assert env.policy.calibration.trust(R[1]) == 1.0
    assert h.free_blocks(R[1], env.clock.t) is None
    assert h.free_blocks(R[2], env.clock.t) is not None


async def test_the_look_aheads_forecasts_are_explained_and_counted(
    registry: RendererRegistry,
) -> None:
    env = Env(registry)
    r = req(chat("forecast please", "a", "b"), session="f")
    await env.hold(R[1], req(chat("forecast please")))
    dry = await env.policy.decide(r, R, commit=False)
    outlook = dry.detail["outlook"]
    assert set(outlook) == set(R)
    assert set(outlook[R[1]]) == {"displaced_tokens", "retained_tokens", "pool_wait_s"}
    assert env.value("router_kv_outlook_pool_wait_seconds_total", replica="r1") == 0.0
    d = await env.policy.route(r, R)
    terms = env.policy.outlook.last[d.replica]
    for name, value in (("displaced_tokens", terms.displaced_tokens),
                        ("retained_tokens", terms.retained_tokens)):
        assert env.value(f"router_kv_outlook_{name}_total", replica=d.replica) == value
    # the series exist for the chosen replica (a forecast of nothing is still counted)
    assert env.prom.get_sample_value("router_kv_outlook_pool_wait_seconds_total",
                                     {"replica": d.replica}) is not None


async def test_a_turn_another_worker_routed_keeps_the_run_fresh(
    registry: RendererRegistry,
) -> None:
    # Two workers (or routers) on one index, each with its own session table: worker A
    # routed turn 1, worker B turn 2 to the same replica; since A's record of turn 1 the
    # replica allocated more than the free pool ahead of that turn's blocks.  Aged from
    # A's record the run would be gone, but the index shows turn 2's blocks there, stored
    # after it: A predicts the whole run, as the replica then reports it.
    index = InMemoryIndex()
    a, b = Env(registry, index=index), Env(registry, index=index)
    for env in (a, b):
        env.policy.horizon.observe_scrape(
            R[1], PoolSample(env.clock.t, 16, 1000, 0.5, None, None), count_allocations=False)
    t1 = req(chat("two workers, one session"), session="s")
    await a.hold(R[1], req(chat("shared start")))  # nothing of the session yet
    d1 = await a.policy.route(t1, R)
    replica = d1.replica
    await a.hold(replica, t1)
    a.policy.record(t1, d1, Receipt(replica, True, prompt_tokens=(await a.prompt(t1)).num_tokens,
                                    cached_tokens=0, completion_tokens=5))
    t2 = req(chat("two workers, one session", "an answer", "a second question"), session="s")
    b.clock.t += 30
    d2 = await b.policy.route(t2, R)
    assert d2.replica == replica
    await b.hold(replica, t2)
    b.policy.record(t2, d2, Receipt(replica, True, prompt_tokens=(await b.prompt(t2)).num_tokens,
                                    cached_tokens=d2.predicted_cached_tokens or 0,
                                    completion_tokens=5))
    a.clock.t += 60
    a.policy.horizon.observe_allocated(replica, a.clock.t, 600.0)  # > the 500 ahead of t1
    t3 = req(chat("two workers, one session", "an answer", "a second question",
                  "another answer", "a third question"), session="s")
    held = len((await a.prompt(t2)).block_keys)
    d3 = await a.policy.decide(t3, R, commit=False)
    assert d3.replica == replica
    assert d3.predicted_cached_tokens == held * 16
