"""The oracle bound on hand-made request sequences."""

from __future__ import annotations

import pytest

from bench.oracle import OracleRequest, oracle_bound

B = 4


def toks(*blocks: int, tail: int = 1) -> list[int]:
    """Full blocks of repeated ids, plus ``tail`` extra tokens (a partial block)."""
    return [t for b in blocks for t in [b] * B] + [999] * tail


def run(reqs: list[OracleRequest], replicas: int = 2, blocks: int = 100):  # type: ignore[no-untyped-def]
    return oracle_bound(reqs, block_size=B, replicas=replicas, blocks_per_replica=blocks,
                        model="m")


def test_conversation_growth_is_saved_by_every_bound() -> None:
    turns = [OracleRequest(toks(*range(1, n))) for n in (3, 4, 5)]
    r = run(turns)
    assert r.prompt_tokens == 9 + 13 + 17
    assert r.oracle_saved == r.pooled_saved == r.unbounded_saved == (2 + 3) * B
    assert r.oracle_share == pytest.approx(20 / 39)


def test_last_token_rule_and_salt() -> None:
    exact = toks(1, 2, tail=0)  # 8 tokens: at most (8-1)//4 = 1 block can hit
    assert run([OracleRequest(exact), OracleRequest(exact)]).unbounded_saved == B
    salted = [OracleRequest(toks(1, 2), cache_salt="a"), OracleRequest(toks(1, 2), cache_salt="b")]
    assert run(salted).unbounded_saved == 0


def test_capacity_and_lru_eviction_from_the_tail() -> None:
    # replica pool of 3 blocks: A's 2 blocks, then C's 2 blocks evict A's *tail* block first
    reqs = [OracleRequest(toks(1, 2)), OracleRequest(toks(5, 6)), OracleRequest(toks(1, 2, 3))]
    one = run(reqs, replicas=1, blocks=3)
    assert one.unbounded_saved == 2 * B
    assert one.oracle_saved == 1 * B  # block 1 survived, block 2 was evicted
    # two replicas: the second conversation goes to the idle replica, nothing is evicted
    assert run(reqs, replicas=2, blocks=3).oracle_saved == 2 * B


def test_output_blocks_take_room() -> None:
    def reqs(out: int) -> list[OracleRequest]:
        return [OracleRequest(toks(1, 2)), OracleRequest(toks(5, 6), output_tokens=out),
                OracleRequest(toks(1, 2, 3))]

    assert run(reqs(0), replicas=1, blocks=4).oracle_saved == 2 * B
    # the other conversation's generated blocks push the first one out
    assert run(reqs(4 * B), replicas=1, blocks=4).oracle_saved == 0
    # a request's own generated blocks are evicted before its prompt (tail first)
    own = [OracleRequest(toks(1, 2), output_tokens=4 * B), OracleRequest(toks(1, 2, 3))]
    assert run(own, replicas=1, blocks=4).oracle_saved == 2 * B


def test_pooled_dedups_a_shared_prefix() -> None:
    shared = [OracleRequest(toks(7, 7, 7, i)) for i in range(10, 16)]
    r = run(shared, replicas=3, blocks=100)
    # the fleet oracle follows the shared prefix onto one replica: it is cached once
    assert r.oracle_saved == r.pooled_saved == 5 * 3 * B


def test_validation() -> None:
    with pytest.raises(ValueError):
        oracle_bound([], block_size=0, replicas=1, blocks_per_replica=1, model="m")
