"""kvroute end to end on real vLLM: two CPU replicas of the tiny model with KV events, a
Redis index, and ``kvroute serve`` in front, driven with the official ``openai`` client.

* Multi-turn conversations: every later turn lands on the replica that served the
  earlier ones; the engine reports ``cached_tokens`` covering the previous prompt's full
  blocks; the router's ``x-kvroute-predicted-cached-tokens`` equals that report.
* A replica is killed while requests are running: none is lost (non-streaming requests
  fail over before their first byte), the dead replica's entries leave the Redis index,
  and once it is restarted it gets traffic again and its cache is predicted exactly.
* The deployment's vLLM command lines (docker-compose.yml) parse with vLLM 0.32's own
  argument parser, and every ``vllm:`` series the Grafana dashboard queries is exported
  by the real engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from kvroute_procs import (
    QUESTIONS,
    THINK_S,
    Conversation,
    KvrouteProcess,
    Turn,
    chosen,
    empty_caches,
    full_blocks,
    index_entries,
    metric_value,
    router_config,
    send_turn,
    start_router,
    wait_indexed,
)
from vllm_fleet import VllmReplica

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

# --- the deployment files against real vLLM ---------------------------------------------------

_PARSE_VLLM_ARGS = r"""
import contextlib, io, json, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
results = []
for argv in json.load(sys.stdin):
    parser = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    cmd.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["serve", *argv])
            cmd.validate(args)
    except SystemExit as exc:
        results.append({"ok": False, "error": f"exit {exc.code}: {err.getvalue()[-2000:]}"})
        continue
    kv = args.kv_events_config
    results.append({
        "ok": True,
        "model": args.model_tag,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "kv_events": None if kv is None else {
            "enable_kv_cache_events": kv.enable_kv_cache_events, "publisher": kv.publisher,
            "endpoint": kv.endpoint, "replay_endpoint": kv.replay_endpoint,
        },
    })
print("RESULT " + json.dumps(results))
"""


def test_compose_vllm_command_lines_parse_with_vllm(vllm_python: Path) -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text("utf-8"))
    vllm = {
        name: [str(a) for a in svc["command"]]
        for name, svc in compose["services"].items()
        if str(svc.get("image", "")).startswith("vllm/vllm-openai:")
    }
    assert len(vllm) >= 2
    # The last entry is a negative control: vLLM's parser must reject an unknown flag.
    argvs = [*vllm.values(), [*next(iter(vllm.values())), "--no-such-flag"]]
    proc = subprocess.run(
        [str(vllm_python), "-c", _PARSE_VLLM_ARGS], input=json.dumps(argvs),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    *results, control = json.loads(lines[-1].removeprefix("RESULT "))
    assert not control["ok"] and "--no-such-flag" in control["error"]
    for name, result in zip(vllm, results, strict=True):
        assert result["ok"], f"{name}: {result['error']}"
        assert result["enable_prefix_caching"] is True, name
        assert result["enable_prompt_tokens_details"] is True, name
        kv = result["kv_events"]
        assert kv["enable_kv_cache_events"] and kv["publisher"] == "zmq", name
        assert kv["endpoint"].startswith("tcp://*:") and kv["replay_endpoint"], name


def _dashboard_vllm_series() -> set[str]:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/kvroute.json").read_text("utf-8"))
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            if node.name.startswith("vllm:"):
                names.add(node.name)

    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m")
            promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_dashboard_vllm_series_are_exported_by_real_vllm(
    vllm_fleet: list[VllmReplica],
) -> None:
    replica = vllm_fleet[0]
    if not replica.alive:
        replica.restart()
    httpx.post(
        replica.url + "/v1/completions",
        json={"model": replica.served_model_name, "prompt": "hello", "max_tokens": 2},
        timeout=120.0,
    ).raise_for_status()
    text = httpx.get(replica.url + "/metrics", timeout=10.0).text
    exported = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    wanted = _dashboard_vllm_series()
    assert wanted, "the dashboard queries no vllm: series"
    assert wanted <= exported, sorted(wanted - exported)


# --- routing through kvroute ------------------------------------------------------------------


@dataclass
class Stack:
    """The router under test and what it routes to."""

    router: KvrouteProcess
    replicas: list[VllmReplica]
    redis_url: str
    key_prefix: str
    model: str

    @property
    def block_size(self) -> int:
        """The replicas' KV block size."""
        return self.replicas[0].block_size

    def conversation(self, topic: str) -> Conversation:
        """A new conversation on the fleet's model."""
        return Conversation.new(self.model, topic)

    def entries(self, replica_id: str) -> int:
        """Blocks the Redis index attributes to ``replica_id``."""
        return index_entries(self.redis_url, self.key_prefix, replica_id)


@pytest.fixture(scope="module")
def stack(
    vllm_fleet: list[VllmReplica],
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """kvroute (kv policy, Redis index, KV events from both replicas) in front of the
    e2e fleet, both replicas' caches emptied first."""
    empty_caches(vllm_fleet)
    workdir = tmp_path_factory.mktemp("router")
    prefix = f"e2e-{uuid.uuid4().hex[:8]}:"
    config = router_config(
        workdir / "router.yaml", replicas=vllm_fleet, redis_url=redis_url,
        key_prefix=prefix, tokenizer_dir=tiny_model_dir,
    )  # fmt: skip
    router = start_router(config, workdir / "router.log")
    try:
        yield Stack(router, vllm_fleet, redis_url, prefix, vllm_fleet[0].served_model_name)
    finally:
        router.stop()


def test_later_turns_follow_their_cache_and_predictions_match(stack: Stack) -> None:
    convs = [stack.conversation(topic) for topic in ("brakes", "gears")]
    for conv in convs:
        send_turn(stack.router, conv, QUESTIONS[0])
        time.sleep(THINK_S)
    for question in QUESTIONS[1:]:
        for conv in convs:
            time.sleep(THINK_S)
            wait_indexed(stack.router, conv, question, stack.block_size)
            previous = conv.turns[-1]
            turn = send_turn(stack.router, conv, question)
            assert turn.replica == previous.replica, (conv.session, conv.turns)
            assert turn.cached >= full_blocks(previous.prompt_tokens, stack.block_size), conv.turns
            assert turn.predicted == turn.cached, (conv.session, conv.turns)


def test_a_killed_replica_loses_no_request_and_comes_back(stack: Stack) -> None:
    # Conversations held by one replica, the victim (their next turns stick to it).
    held: list[Conversation] = []
    for i in range(12):
        conv = stack.conversation(f"held-{i}")
        replica = send_turn(stack.router, conv, QUESTIONS[0]).replica
        time.sleep(THINK_S)
        if not held or replica == held[0].turns[0].replica:
            held.append(conv)
        if len(held) == 3:
            break
    assert len(held) >= 2, "conversations never shared a replica"
    victim = next(r for r in stack.replicas if r.id == held[0].turns[0].replica)
    survivor = next(r for r in stack.replicas if r is not victim)
    for conv in held:
        wait_indexed(stack.router, conv, QUESTIONS[1], stack.block_size)
    assert stack.entries(victim.id) > 0
    failovers_before = metric_value(stack.router, "router_failovers_total", replica=victim.id)

    # Their next turns, plus new conversations, are running when the victim crashes.  They
    # are non-streaming (nothing reaches a client before the response is complete), so a
    # request cut off by the crash must be retried on the survivor: none may be lost.
    def later(conv: Conversation) -> Turn:
        # Long answers (about a second or more on the CPU engine), so they are caught
        # running.
        return send_turn(stack.router, conv, QUESTIONS[1], answer_tokens=256)

    def fresh(i: int) -> Turn:
        return send_turn(stack.router, stack.conversation(f"load-{i}"), QUESTIONS[i % 3])

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        cut = [pool.submit(later, conv) for conv in held]
        deadline = time.monotonic() + 60.0
        while metric_value(stack.router, "router_inflight_requests", replica=victim.id) < 1:
            assert time.monotonic() < deadline, "the held turns never reached the victim"
            time.sleep(0.01)
        victim.kill()
        others = [pool.submit(fresh, i) for i in range(6)]
        cut_turns = [f.result(timeout=300) for f in cut]  # raises if a request was lost
        other_turns = [f.result(timeout=300) for f in others]
    assert all(t.replica == survivor.id for t in cut_turns), cut_turns
    assert all(t.replica == survivor.id for t in other_turns), other_turns
    failovers = metric_value(stack.router, "router_failovers_total", replica=victim.id)
    assert failovers - failovers_before >= 1, "the crash cut no request off"

    # The dead replica's blocks leave the index, and no decision points at it.
    deadline = time.monotonic() + 15.0
    while stack.entries(victim.id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.entries(victim.id) == 0, "a dead replica's blocks stay in the index"
    conv = held[0]
    decision = stack.router.debug_route(stack.model, conv.next_messages(QUESTIONS[2]),
                                        conv.session)
    assert chosen(decision) == survivor.id

    # Back again: it becomes a routing choice, serves, and its cache is predicted exactly.
    victim.restart()
    back: Conversation | None = None
    deadline = time.monotonic() + 30.0
    while back is None and time.monotonic() < deadline:
        # A prompt the survivor holds nothing of: routed by session affinity.
        conv = Conversation.new(stack.model, f"back-{uuid.uuid4().hex[:4]}", shared_system=False)
        route = stack.router.debug_route(stack.model, conv.next_messages(QUESTIONS[0]),
                                         conv.session)
        if chosen(route) == victim.id:
            back = conv
        else:
            time.sleep(0.1)
    assert back is not None, "the restarted replica never became a routing choice"
    assert send_turn(stack.router, back, QUESTIONS[0]).replica == victim.id
    wait_indexed(stack.router, back, QUESTIONS[1], stack.block_size)
    second = send_turn(stack.router, back, QUESTIONS[1])
    assert second.replica == victim.id
    assert second.predicted == second.cached >= full_blocks(
        back.turns[0].prompt_tokens, stack.block_size
    ) > 0
