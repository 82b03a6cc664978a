"""kvroute routers for the end-to-end tests, started and driven as a user would.

* ``KvrouteProcess`` runs ``python -m kvroute.cli <argv>`` (the ``kvroute`` command) in
  its own process group with its output in a log file, waits for an HTTP path to answer
  200, and stops it (SIGTERM, then SIGKILL).  ``start_router`` starts ``kvroute serve``.
* ``router_config`` writes the YAML a deployment would mount: the e2e fleet's real vLLM
  replicas with their KV-event and replay endpoints, the model's tokenizer and block
  size for the ``kv`` policy, and the shared Redis index.
* ``Conversation`` / ``send_turn``: a multi-turn chat through a router with the official
  ``openai`` client, recording per turn where it went (``x-kvroute-replica``), what the
  router predicted (``x-kvroute-predicted-cached-tokens``) and what the engine reported
  (``usage.prompt_tokens_details.cached_tokens``).
* ``debug_route``, ``wait_indexed``, ``index_entries``, ``metric_value``: the router's
  decision without sending, waiting for KV events to reach the index, the Redis index's
  size per replica, and one series of the router's ``/metrics``.

Imported by the e2e test modules as ``kvroute_procs`` (``conftest.py`` puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_fleet import VllmReplica, log_tail

from tests.ports import free_port

SYSTEM = (
    "You are the support assistant of a bicycle repair shop. Answer in one short sentence, "
    "quote the price list when asked about prices, and ask for the frame number first. "
)
THINK_S = 1.0
"""A user's pause between two requests.  Besides realism it paces the test's traffic:
the routers estimate each replica's eviction horizon from its block allocation rate, and
back-to-back turns on the e2e fleet's 64-block pools would make that horizon shorter
than the gap between a conversation's turns, i.e. predict an eviction that a paced
workload of this size never causes."""
QUESTIONS = [
    "My rear brake squeaks when it rains. What should I check first?",
    "And how much does a new set of brake pads cost, fitted?",
    "Can you also true the rear wheel while it is in the shop?",
]


def empty_caches(replicas: Sequence[VllmReplica]) -> None:
    """Start from empty prefix caches, with the engines' ``AllBlocksCleared`` already
    published.

    Restarts a dead replica, then ``POST /reset_prefix_cache``.  vLLM 0.32 publishes the
    resulting ``AllBlocksCleared`` only with its next engine step, so each replica then
    serves one request too short to fill a block (it stores nothing): a router started
    afterwards finds the clear in the replay buffer instead of meeting it, as a reset,
    in the middle of a test.
    """
    for replica in replicas:
        if not replica.alive:
            replica.restart()
        replica.reset_prefix_cache()
        httpx.post(
            replica.url + "/v1/completions",
            json={"model": replica.served_model_name, "prompt": "hi", "max_tokens": 1},
            timeout=120.0,
        ).raise_for_status()


def router_config(
    path: Path,
    *,
    replicas: Sequence[VllmReplica],
    redis_url: str,
    key_prefix: str,
    tokenizer_dir: Path,
    policy: str = "kv",
) -> Path:
    """Write a router config for ``replicas`` sharing the Redis index at ``key_prefix``."""
    first = replicas[0]
    config: dict[str, Any] = {
        "policy": policy,
        "replicas": [
            {
                "id": r.id,
                "url": r.url,
                "kv_events_endpoint": r.events_endpoint,
                "replay_endpoint": r.replay_endpoint,
            }
            for r in replicas
        ],
        # Two CPU engines share the test machine's two cores with Redis and the router:
        # an index operation can take far longer than on a production host, and a timeout
        # would turn into an affinity decision without a prediction.
        "index": {
            "backend": "redis", "url": redis_url, "key_prefix": key_prefix,
            "op_timeout_s": 2.0,
        },
        # Fast hysteresis: a killed replica is out, and a restarted one back, within ~1 s.
        "health": {"interval_s": 0.5, "fails_to_down": 1, "successes_to_up": 1},
        "scoring": {
            "models": [
                {
                    "name": first.served_model_name,
                    "block_size": first.block_size,
                    "tokenizer": str(tokenizer_dir),
                    "max_model_len": first.spec.max_model_len,
                }
            ],
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


@dataclass
class KvrouteProcess:
    """One ``kvroute`` subcommand running as a child process."""

    argv: list[str]
    log_path: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the process (output appended to ``log_path``)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvroute.cli", *self.argv],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def wait_ok(self, path: str, timeout_s: float = 60.0) -> None:
        """Block until ``GET path`` answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.alive:
                    raise RuntimeError(
                        f"kvroute {self.argv[0]} exited; log {self.log_path}:\n"
                        f"{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + path).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"kvroute {self.argv[0]}: {path} not 200 after {timeout_s:.0f} s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.1)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL after ``grace_s``."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def client(self) -> openai.OpenAI:
        """The official ``openai`` client pointed at this router (no client retries)."""
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120.0
        )

    def debug_route(
        self, model: str, messages: list[dict[str, str]], session: str
    ) -> dict[str, Any]:
        """The router's decision for a chat request, without sending it."""
        r = httpx.post(
            self.url + "/debug/route",
            json={"model": model, "messages": messages, "max_tokens": 8},
            headers={"X-Session-ID": session},
            timeout=10.0,
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body


def start_router(config: Path, log_path: Path, timeout_s: float = 60.0) -> KvrouteProcess:
    """``kvroute serve --config FILE`` on a free loopback port, ready (``/ready`` is 200)."""
    port = free_port()
    router = KvrouteProcess(
        ["serve", "--host", "127.0.0.1", "--port", str(port), "--config", str(config)],
        log_path, port,
    )  # fmt: skip
    router.start()
    try:
        router.wait_ok("/ready", timeout_s)
    except BaseException:
        router.stop(grace_s=5.0)
        raise
    return router


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

    model: str
    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    @classmethod
    def new(cls, model: str, topic: str, *, shared_system: bool = True) -> Conversation:
        """A conversation with a customer file of its own, after the system prompt all
        conversations share (or, with ``shared_system=False``, a prompt sharing no full
        block with any other conversation)."""
        session = f"conv-{uuid.uuid4().hex[:8]}"
        own = f"Customer file {session}, topic: {topic}."
        system = SYSTEM + own if shared_system else own + " " + SYSTEM
        return cls(model, session, [{"role": "system", "content": system}])

    def next_messages(self, question: str) -> list[dict[str, str]]:
        """The messages of the next turn if ``question`` is asked."""
        return [*self.messages, {"role": "user", "content": question}]


def send_turn(
    router: KvrouteProcess, conv: Conversation, question: str, *, answer_tokens: int = 8
) -> Turn:
    """Ask ``question`` in ``conv`` through ``router`` (non-streaming, greedy, exactly
    ``answer_tokens`` generated); record where it went."""
    conv.messages.append({"role": "user", "content": question})
    raw = router.client().chat.completions.with_raw_response.create(
        model=conv.model,
        messages=conv.messages,  # type: ignore[arg-type]
        max_tokens=answer_tokens,
        temperature=0.0,
        extra_headers={"X-Session-ID": conv.session},
        extra_body={"ignore_eos": True},
    )
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    content = completion.choices[0].message.content or ""
    conv.messages.append({"role": "assistant", "content": content})
    predicted = raw.headers.get("x-kvroute-predicted-cached-tokens")
    assert predicted is not None, (
        f"no prediction (reason {raw.headers.get('x-kvroute-reason')}; kv fallbacks "
        f"{metric_value(router, 'router_kv_fallbacks_total')})"
    )
    turn = Turn(
        replica=raw.headers["x-kvroute-replica"],
        predicted=int(predicted),
        cached=usage.prompt_tokens_details.cached_tokens or 0,
        prompt_tokens=usage.prompt_tokens,
        content=content,
    )
    conv.turns.append(turn)
    return turn


def chosen(decision: dict[str, Any]) -> str:
    """The replica a ``/debug/route`` decision picks (the first of its ordered list)."""
    replica: str = decision["replicas"][0]
    return replica


def full_blocks(tokens: int, block_size: int) -> int:
    """Tokens in the full blocks of a ``tokens``-long prompt."""
    return (tokens // block_size) * block_size


def wait_indexed(
    router: KvrouteProcess,
    conv: Conversation,
    question: str,
    block_size: int,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Wait until ``router`` would send ``conv``'s next turn to the replica of its last
    turn, predicting at least that turn's full blocks; return the decision.

    KV events are published by the engine after the response and ingested
    asynchronously; a user's think time hides that lag, a test has to wait for it.
    """
    last = conv.turns[-1]
    want = full_blocks(last.prompt_tokens, block_size)
    deadline = time.monotonic() + timeout_s
    decision: dict[str, Any] = {}
    while time.monotonic() < deadline:
        decision = router.debug_route(conv.model, conv.next_messages(question), conv.session)
        if chosen(decision) == last.replica and decision["predicted_cached_tokens"] >= want:
            return decision
        time.sleep(0.1)
    raise AssertionError(f"the index never caught up with {last}; last decision {decision}")


def index_entries(redis_url: str, key_prefix: str, replica_id: str) -> int:
    """Blocks the Redis index attributes to ``replica_id`` (its engine-key map's size)."""
    ns = key_prefix.rstrip(":")
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        count: int = client.hlen(f"{ns}:e:{replica_id}")
        return count
    finally:
        client.close()


def metric_value(router: KvrouteProcess, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``router``'s ``/metrics`` matching ``labels``."""
    text = httpx.get(router.url + "/metrics", timeout=5.0).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
