"""Two kvroute routers sharing one Redis index, in front of the same two real vLLM replicas.

Each replica's KV events are ingested by exactly one of the routers (the Redis lease);
the other reads the same index.  So whichever router a client's next turn reaches, it
routes it to the replica holding the conversation, with the same prediction, and the
engine's ``cached_tokens`` confirm it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kvroute_procs import (
    QUESTIONS,
    THINK_S,
    Conversation,
    KvrouteProcess,
    chosen,
    empty_caches,
    full_blocks,
    router_config,
    send_turn,
    start_router,
    wait_indexed,
)
from vllm_fleet import VllmReplica

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def routers(
    vllm_fleet: list[VllmReplica],
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[KvrouteProcess, KvrouteProcess, str]]:
    """Two routers on one config (one Redis namespace); yields them and the namespace."""
    empty_caches(vllm_fleet)
    workdir = tmp_path_factory.mktemp("two-routers")
    prefix = f"e2e2-{uuid.uuid4().hex[:8]}:"
    config = router_config(
        workdir / "router.yaml", replicas=vllm_fleet, redis_url=redis_url,
        key_prefix=prefix, tokenizer_dir=tiny_model_dir,
    )  # fmt: skip
    first = start_router(config, workdir / "router-1.log")
    try:
        second = start_router(config, workdir / "router-2.log")
        try:
            yield first, second, prefix
        finally:
            second.stop()
    finally:
        first.stop()


def test_each_replica_is_ingested_by_one_router(
    routers: tuple[KvrouteProcess, KvrouteProcess, str],
    vllm_fleet: list[VllmReplica],
    redis_url: str,
) -> None:
    _, _, prefix = routers
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        for replica in vllm_fleet:
            # index.ingestion names a replica's lease <ns>:lease:src:<replica id>.
            key = f"{prefix.rstrip(':')}:lease:src:{replica.id}"
            holder = client.get(key)
            assert holder, f"nobody holds the ingestion lease of {replica.id} ({key})"
    finally:
        client.close()


def test_either_router_sends_the_next_turn_where_the_cache_is(
    routers: tuple[KvrouteProcess, KvrouteProcess, str],
    vllm_fleet: list[VllmReplica],
) -> None:
    first, second = routers[0], routers[1]
    model, block = vllm_fleet[0].served_model_name, vllm_fleet[0].block_size
    convs = [Conversation.new(model, f"two-routers-{i}") for i in range(2)]
    for conv in convs:
        send_turn(first, conv, QUESTIONS[0])
        time.sleep(THINK_S)
    # Turn 2 through the other router, turn 3 back through the first one.
    for question, via, other in ((QUESTIONS[1], second, first), (QUESTIONS[2], first, second)):
        for conv in convs:
            time.sleep(THINK_S)
            previous = conv.turns[-1]
            decision = wait_indexed(via, conv, question, block)
            same = other.debug_route(model, conv.next_messages(question), conv.session)
            assert chosen(same) == chosen(decision) == previous.replica, json.dumps(
                {"previous": previous.replica, "other": same, "via": decision}, indent=1
            )
            assert same["predicted_cached_tokens"] == decision["predicted_cached_tokens"]
            turn = send_turn(via, conv, question)
            assert turn.replica == previous.replica, conv.turns
            assert turn.cached >= full_blocks(previous.prompt_tokens, block), conv.turns
            assert turn.predicted == turn.cached, conv.turns
