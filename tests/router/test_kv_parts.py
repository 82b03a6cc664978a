"""The kv policy's parts on their own: the choice, the replica view's accounting, the
session tracker's tail, and the ticket that carries a decision's state to ``record``."""

from __future__ import annotations

import pytest

from index.memory import InMemoryIndex
from kvkeys.keys import block_keys
from kvkeys.types import PrefixHits, ReplicaHit, ReplicaId
from prompt.keyer import Prompt
from router.affinity import AffinityKey
from router.horizon import HorizonEstimator, PoolSample
from router.kv_choice import ChoiceRules, Fallback, choose
from router.kv_policy import KvPolicy, KvTicket
from router.load import LoadTracker
from router.policy import Receipt, RouteRequest
from router.prefix_breaks import pack_tokens
from router.receipts import ReceiptCalibration
from router.replica_view import ReplicaView, SessionTail
from router.scoring import CostModel, ReplicaScore, ScoringWeights
from router.session_table import SessionState, SessionTable
from router.session_tracker import SessionTracker
from tests.router.helpers import replica_score as score

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
RULES = ChoiceRules(ScoringWeights(), min_hit_tokens=64, temperature=0.0,
                    balance_abs_tokens=4096.0, balance_rel=2.0)
PREFERENCE = {A: 0, B: 1, C: 2}


def never() -> float:
    raise AssertionError("no draw at temperature 0")


@pytest.mark.parametrize(
    ("ranked", "fallback", "sighted", "sticky", "reason", "first"),
    [
        # the best score holds the best hit
        ([score(B, 512, -10), score(A, 0, -500)], None, True, None, "kv_hit", B),
        # load outweighed a better hit elsewhere
        ([score(A, 0, -500), score(B, 512, -9000, 8500)], None, True, None, "kv_load", A),
        # no useful hit, every source live: a new prefix placed by score
        ([score(C, 0, -5), score(A, 0, -6)], None, True, None, "kv_new", C),
        # no useful hit, some source not live: affinity (ring order)
        ([score(C, 0, -5), score(A, 0, -6)], None, False, None, "affinity_no_hit", A),
        # the session's previous replica goes first under a fallback
        ([score(C, 0, -5), score(A, 0, -6)], "index_down", True, C, "affinity_index_down", C),
        # an overloaded pinned replica yields to the least loaded
        ([score(A, 0, -9000, 9000), score(B, 0, -100, 100)], "no_prompt", True, None,
         "affinity_overload", B),
    ],
)
def test_choose_reasons(
    ranked: list[ReplicaScore],
    fallback: Fallback | None,
    sighted: bool,
    sticky: ReplicaId | None,
    reason: str,
    first: ReplicaId,
) -> None:
    choice = choose(ranked, PREFERENCE, RULES, fallback=fallback, sighted=sighted,
                    sticky=sticky, sample=never)
    assert (choice.reason, choice.chosen.replica) == (reason, first)
    assert {s.replica for s in choice.ordered} == {s.replica for s in ranked}


def test_choose_compares_hits_in_whole_blocks() -> None:
    # A shared 64-token prompt credited with a trust just under one: 63.9998 expected
    # tokens are 4 blocks of 16, as many as min_hit_tokens asks for (no fallback), and
    # every replica holds them: the label says so instead of kv_hit or kv_new.
    ranked = [score(B, 63.9998, -10), score(A, 64.0, -11), score(C, 64.0, -12)]
    for sighted in (True, False):
        choice = choose(ranked, PREFERENCE, RULES, fallback=None, sighted=sighted,
                        sticky=None, sample=never, block_size=16)
        assert (choice.reason, choice.chosen.replica) == ("kv_shared", B)
    # A hit a rounding error short of the best one is not a load decision either.
    ranked = [score(B, 511.9999, -10), score(A, 512.0, -11), score(C, 0.0, -12)]
    choice = choose(ranked, PREFERENCE, RULES, fallback=None, sighted=True, sticky=None,
                    sample=never, block_size=16)
    assert choice.reason == "kv_hit"
    # Under one block's worth short of min_hit_tokens is still short of it.
    ranked = [score(B, 47.9, -10), score(A, 0.0, -11)]
    choice = choose(ranked, PREFERENCE, RULES, fallback=None, sighted=False, sticky=None,
                    sample=never, block_size=16)
    assert choice.reason == "affinity_no_hit"


def test_choose_draws_only_when_sampling() -> None:
    draws: list[float] = []

    def sample() -> float:
        draws.append(0.99)
        return 0.99

    hot = ChoiceRules(ScoringWeights(), 64, 1e9, 4096.0, 2.0)
    ranked = [score(A, 512, -1), score(B, 512, -2)]
    choose(ranked, PREFERENCE, hot, fallback="index_down", sighted=True, sticky=None,
           sample=sample)
    assert draws == []
    choice = choose(ranked, PREFERENCE, hot, fallback=None, sighted=True, sticky=None,
                    sample=sample)
    assert draws == [0.99] and choice.fallback is None


def view(load: LoadTracker, horizon: HorizonEstimator) -> ReplicaView:
    return ReplicaView(
        load=load, horizon=horizon, calibration=ReceiptCalibration(),
        statuses=lambda r: None, scraper=None, weights=ScoringWeights(),
        costs=CostModel(prefill_tokens_per_s=1000.0), foreign_prefill_tokens_per_request=512.0,
        placement_tau_s=300.0,
    )


def test_view_caps_what_we_sent_by_the_fluid_queue_and_counts_placements() -> None:
    load = LoadTracker([A, B])
    v = view(load, HorizonEstimator())
    with load.lease(A, 3000):
        v.sent(A, 3000, 0.0, new_conversation=True)
        inputs, sighted = v.inputs([A, B], PrefixHits(), 1.0, 0.0, tail=None,
                                   new_conversation=True)
        by = {i.replica: i for i in inputs}
        assert not sighted  # no event source known
        # 3000 sent, 1000 prefilled in the second since: 2000 left
        assert by[A].load.queued_prefill_tokens == pytest.approx(2000)
        assert by[A].load.placements == pytest.approx(1.0, rel=1e-2)
        assert by[B].load.placements == 0.0
        # an existing conversation never pays placements
        again, _ = v.inputs([A], PrefixHits(), 1.0, 0.0, tail=None, new_conversation=False)
        assert again[0].load.placements == 0.0
    v.finished(A, 3000)
    with load.lease(A, 500):
        inputs, _ = v.inputs([A], PrefixHits(), 1.0, 0.0, tail=None, new_conversation=False)
    assert inputs[0].load.queued_prefill_tokens == 500  # someone else's request: uncapped
    rows = list(v.gauge_rows(1.0))
    assert ("router_kv_index_trust", "a", 1.0) in rows


def test_view_gives_the_tail_to_its_replica_only() -> None:
    v = view(LoadTracker([A, B]), HorizonEstimator())
    hits = PrefixHits({A: ReplicaHit(gpu_blocks=4), B: ReplicaHit(gpu_blocks=2)})
    inputs, _ = v.inputs([A, B], hits, 0.0, 0.0, tail=SessionTail(B, 0.5, 100.0, 3),
                         new_conversation=False)
    by = {i.replica: i for i in inputs}
    assert (by[B].tail_consumed, by[B].tail_queue_blocks, by[B].tail_run_blocks) == (0.5, 100, 3)
    assert (by[A].tail_consumed, by[A].tail_queue_blocks, by[A].tail_run_blocks) == (0, None, 0)
    assert (by[A].hot_blocks, by[B].hot_blocks) == (2, 2)  # the second-longest run


def tracker(horizon: HorizonEstimator) -> SessionTracker:
    return SessionTracker(
        sessions=SessionTable(), horizon=horizon, calibration=ReceiptCalibration(),
        metrics=None, policy_name="kv", detect_prefix_breaks=True,
        receipt_large_abs_tokens=64, receipt_large_rel=0.1,
    )


def test_tracker_tail_from_allocations_since_the_turn_finished() -> None:
    h = HorizonEstimator()
    h.observe_scrape(A, PoolSample(0.0, 16, 1000, 0.5, None, None), count_allocations=False)
    t = tracker(h)
    assert t.session_of(AffinityKey("k", "prompt_prefix")) is None
    key = AffinityKey("k", "session")
    assert t.session_of(key) == "k" and t.previous(key) is None
    t.sessions.turn("k", A, 0.0, b"", None)
    running = t.previous(key)
    assert running is not None and t.tail(running, 1.0) == SessionTail(A)  # pinned
    t.finished("k", A, 10, 1.0)
    h.observe_allocated(A, 2.0, 150.0)  # behind the 500 free blocks ahead of its run
    state = t.previous(key)
    assert state is not None
    tail = t.tail(state, 3.0)
    assert tail.consumed == pytest.approx(150 / 500)
    assert (tail.replica, tail.queue_blocks, tail.run_blocks) == (A, 500.0, 10)


def test_tracker_tail_is_fresh_when_the_replica_holds_more_than_the_turn_left() -> None:
    """Another worker (or router) routed a later turn of the session to the same replica:
    the index shows more of the prompt there than the turn this process saw released, so
    that run was used after the record and is not aged from it."""
    h = HorizonEstimator()
    h.observe_scrape(A, PoolSample(0.0, 16, 1000, 0.5, None, None), count_allocations=False)
    t = tracker(h)
    key = AffinityKey("k", "session")
    t.sessions.turn("k", A, 0.0, b"", None)
    t.finished("k", A, 10, 1.0)  # this process's last turn released 10 blocks
    h.observe_allocated(A, 2.0, 600.0)  # more than the 500 free blocks ahead of it
    state = t.previous(key)
    assert state is not None
    assert t.tail(state, 3.0).consumed == pytest.approx(600 / 500)  # aged: evicted
    assert t.tail(state, 3.0, held_blocks=10).consumed == pytest.approx(600 / 500)
    assert t.tail(state, 3.0, held_blocks=11) == SessionTail(A)  # a later turn's blocks


def test_tracker_tail_without_marks_uses_the_horizon() -> None:
    t = tracker(HorizonEstimator())
    state = SessionState(A, 0.0, finished_at=5.0)
    assert t.tail(state, 50.0) == SessionTail(A)  # unknown horizon: no eviction risk


def test_ticket_released_blocks() -> None:
    ticket = KvTicket(session=None, prompt_tokens=100, block_size=16,
                      calibration_cached_tokens=None)
    assert ticket.released_blocks(Receipt(A, True)) == 7  # 100 / 16, rounded up
    assert ticket.released_blocks(Receipt(A, True, prompt_tokens=320,
                                          completion_tokens=1)) == 21
    unrendered = KvTicket(None, None, None, None)
    assert unrendered.released_blocks(Receipt(A, True, prompt_tokens=320)) is None


class _FixedPrompt:
    """Every request renders to the same 160-token prompt (block size 16)."""

    def __init__(self) -> None:
        ids = list(range(160))
        self.value = Prompt(ids, block_keys(ids, 16, model="m"), 16, "m")

    async def prompt(self, request: RouteRequest, replica_url: str | None) -> Prompt:
        return self.value


async def test_a_prediction_extended_by_provisional_entries_does_not_calibrate() -> None:
    policy = KvPolicy(prompts=_FixedPrompt(), index=InMemoryIndex(), load=LoadTracker([A, B]),
                      replica_url=lambda r: None, clock=lambda: 100.0, wall=lambda: 100.0)
    first = RouteRequest("q1", "chat", "/v1/chat/completions", "m", {"messages": []}, "s")
    burst = RouteRequest("q2", "chat", "/v1/chat/completions", "m", {"messages": []}, "s")
    d1 = await policy.route(first, [A, B])
    d2 = await policy.route(burst, [A, B])  # the index has nothing yet: provisional only
    assert d2.replica == d1.replica and d2.predicted_cached_tokens == 144
    assert d2.ticket is not None and d2.ticket.calibration_cached_tokens is None
    policy.record(burst, d2, Receipt(d2.replica, True, prompt_tokens=160, cached_tokens=0))
    assert policy.calibration.trust(d2.replica) == 1.0


def _turn_prompt(ids: list[int], salt: str | None = None) -> Prompt:
    return Prompt(ids, block_keys(ids, 4, model="m", cache_salt=salt), 4, "m", cache_salt=salt)


@pytest.mark.parametrize(
    ("second", "salt", "breaks"),
    [
        ([*range(10), 50, 51], None, False),  # extends: only the new tokens are packed
        ([*range(9), 99, 50], None, True),  # differs in the previous partial block
        ([0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 50], None, True),  # in its last full block
        ([*range(9)], None, True),  # shorter
        ([*range(10), 50], "other", False),  # another salt, same tokens: keys differ
        ([*range(3)], None, True),  # shorter than a block
    ],
)
def test_tracker_keeps_each_turns_tokens_and_finds_the_breaks(
    second: list[int], salt: str | None, breaks: bool, caplog: pytest.LogCaptureFixture
) -> None:
    t = tracker(HorizonEstimator())
    key = AffinityKey("k", "session")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    request = RouteRequest("r1", "chat", "/v1/chat/completions", "m", body, "k")
    t.turn(request, key, A, _turn_prompt(list(range(10))), 0.0)
    caplog.set_level("INFO", logger="router.session_tracker")
    t.turn(request, key, A, _turn_prompt(second, salt), 1.0)
    state = t.previous(key)
    assert state is not None and state.tokens == pack_tokens(second)
    assert ("prefix break" in caplog.text) == breaks
