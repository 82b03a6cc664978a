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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import promql_parser
import pytest
import redis
import yaml
from kvroute_procs import KvrouteProcess, router_config, start_router
from vllm_fleet import VllmReplica

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

SYSTEM = (
    "You are the support assistant of a bicycle repair shop. Answer in one short sentence, "
    "quote the price list when asked about prices, and ask for the frame number first. "
)
QUESTIONS = [
    "My rear brake squeaks when it rains. What should I check first?",
    "And how much does a new set of brake pads cost, fitted?",
    "Can you also true the rear wheel while it is in the shop?",
]


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
class Turn:
    """One answered request as the client saw it."""

    replica: str
    predicted: int
    cached: int
    prompt_tokens: int
    content: str


@dataclass
class Conversation:
    """A client-side chat history that grows turn by turn."""

    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    @classmethod
    def new(cls, topic: str) -> Conversation:
        """A conversation with the shared system prompt and its own first question."""
        session = f"conv-{uuid.uuid4().hex[:8]}"
        system = SYSTEM + f"Customer file {session}, topic: {topic}."
        return cls(session, [{"role": "system", "content": system}])


@dataclass
class Stack:
    """The router under test and what it routes to."""

    router: KvrouteProcess
    replicas: list[VllmReplica]
    redis_url: str
    key_prefix: str
    model: str

    def client(self) -> openai.OpenAI:
        """The official client, pointed at the router."""
        return openai.OpenAI(
            base_url=self.router.url + "/v1", api_key="unused", max_retries=0, timeout=120.0
        )


@pytest.fixture(scope="module")
def stack(
    vllm_fleet: list[VllmReplica],
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """kvroute (kv policy, Redis index, KV events from both replicas) in front of the
    e2e fleet, with both replicas' caches empty."""
    for replica in vllm_fleet:
        if not replica.alive:
            replica.restart()
        replica.reset_prefix_cache()
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


def debug_route(stack: Stack, messages: list[dict[str, str]], session: str) -> dict[str, Any]:
    """The router's decision for a request, without sending it."""
    r = httpx.post(
        stack.router.url + "/debug/route",
        json={"model": stack.model, "messages": messages, "max_tokens": 8},
        headers={"X-Session-ID": session},
        timeout=10.0,
    )
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def send_turn(stack: Stack, client: openai.OpenAI, conv: Conversation, question: str) -> Turn:
    """Ask ``question`` in ``conv`` through the router; record where it went."""
    conv.messages.append({"role": "user", "content": question})
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model,
        messages=conv.messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        extra_headers={"X-Session-ID": conv.session},
    )
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    content = completion.choices[0].message.content or ""
    conv.messages.append({"role": "assistant", "content": content})
    turn = Turn(
        replica=raw.headers["x-kvroute-replica"],
        predicted=int(raw.headers["x-kvroute-predicted-cached-tokens"]),
        cached=usage.prompt_tokens_details.cached_tokens or 0,
        prompt_tokens=usage.prompt_tokens,
        content=content,
    )
    conv.turns.append(turn)
    return turn


def wait_indexed(stack: Stack, conv: Conversation, question: str, timeout_s: float = 10.0) -> None:
    """Wait until the router's index holds ``conv``'s last prompt on its replica.

    KV events are published by the engine after the response and ingested asynchronously;
    a user's think time hides that lag, a test has to wait for it (typically well under a
    second).
    """
    block = stack.replicas[0].block_size
    last = conv.turns[-1]
    want = (last.prompt_tokens // block) * block
    messages = [*conv.messages, {"role": "user", "content": question}]
    deadline = time.monotonic() + timeout_s
    decision: dict[str, Any] = {}
    while time.monotonic() < deadline:
        decision = debug_route(stack, messages, conv.session)
        if decision["replica"] == last.replica and decision["predicted_cached_tokens"] >= want:
            return
        time.sleep(0.1)
    raise AssertionError(f"index never caught up with {last}: last decision {decision}")


def index_entries(stack: Stack, replica_id: str) -> int:
    """Blocks the Redis index attributes to ``replica_id`` (engine-key map size)."""
    ns = stack.key_prefix.rstrip(":")
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=2.0)
    try:
        count: int = client.hlen(f"{ns}:e:{replica_id}")
        return count
    finally:
        client.close()


def test_later_turns_follow_their_cache_and_predictions_match(stack: Stack) -> None:
    client = stack.client()
    block = stack.replicas[0].block_size
    convs = [Conversation.new(topic) for topic in ("brakes", "gears", "tyres", "lights")]
    for conv in convs:
        send_turn(stack, client, conv, QUESTIONS[0])
    for question in QUESTIONS[1:]:
        for conv in convs:
            wait_indexed(stack, conv, question)
            previous = conv.turns[-1]
            turn = send_turn(stack, client, conv, question)
            assert turn.replica == previous.replica, (conv.session, conv.turns)
            assert turn.cached >= (previous.prompt_tokens // block) * block, conv.turns
            assert turn.predicted == turn.cached, (conv.session, conv.turns)
    # Sessions are spread over both replicas, not piled on one.
    assert {c.turns[0].replica for c in convs} == {r.id for r in stack.replicas}


def test_a_killed_replica_loses_no_request_and_comes_back(stack: Stack) -> None:
    client = stack.client()
    # Warm one conversation on each replica.
    convs: dict[str, Conversation] = {}
    for i in range(8):
        conv = Conversation.new(f"warm-{i}")
        turn = send_turn(stack, client, conv, QUESTIONS[0])
        convs.setdefault(turn.replica, conv)
        if len(convs) == len(stack.replicas):
            break
    assert len(convs) == len(stack.replicas), "could not place a conversation on each replica"
    victim = next(r for r in stack.replicas if r.id in convs)
    survivor = next(r for r in stack.replicas if r is not victim)
    wait_indexed(stack, convs[victim.id], QUESTIONS[1])
    assert index_entries(stack, victim.id) > 0

    # Requests keep flowing (non-streaming: nothing reaches the client before the end, so
    # a request cut off by the crash is retried on the survivor) while the victim dies.
    def one(i: int) -> Turn:
        conv = Conversation.new(f"load-{i}")
        return send_turn(stack, stack.client(), conv, QUESTIONS[i % len(QUESTIONS)])

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        while sum(f.done() for f in futures) < 3:
            time.sleep(0.05)
        victim.kill()
        answered = [f.result(timeout=300) for f in futures]  # raises if any was lost
    assert len(answered) == 12
    after_kill = send_turn(stack, client, convs[victim.id], QUESTIONS[1])
    assert after_kill.replica == survivor.id

    # The dead replica's blocks leave the index.
    deadline = time.monotonic() + 15.0
    while index_entries(stack, victim.id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert index_entries(stack, victim.id) == 0
    decision = debug_route(stack, convs[victim.id].messages, convs[victim.id].session)
    assert decision["replica"] == survivor.id

    # Back again: it gets traffic, and what it caches is predicted exactly.
    victim.restart()
    stack.router.wait_ok("/ready")
    deadline = time.monotonic() + 30.0
    back: Conversation | None = None
    while back is None and time.monotonic() < deadline:
        conv = Conversation.new(f"back-{uuid.uuid4().hex[:4]}")
        decision = debug_route(stack, [*conv.messages, {"role": "user", "content": QUESTIONS[0]}],
                               conv.session)
        if decision["replica"] == victim.id:
            back = conv
        else:
            time.sleep(0.2)
    assert back is not None, "the restarted replica never became a routing choice"
    first = send_turn(stack, client, back, QUESTIONS[0])
    assert first.replica == victim.id
    wait_indexed(stack, back, QUESTIONS[1])
    second = send_turn(stack, client, back, QUESTIONS[1])
    assert second.replica == victim.id and second.predicted == second.cached > 0
