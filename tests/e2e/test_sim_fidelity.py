"""Issue 5 acceptance: the simulated replica behaves like the real vLLM engine.

One scripted multi-turn trace runs sequentially, first against a real vLLM CPU replica
and then against a simulated replica (``kvroute sim``, a separate process) configured the
same way: the same tokenizer directory and served model name, block size 32, a pool of
``--num-gpu-blocks-override 65`` / ``--num-blocks 65`` blocks (both count vLLM's null
block 0, so 64 blocks hold KV), ``max_model_len`` 2,048.  The trace has six
conversations, shared system prompts, two cache salts plus one isolated salt, an exact
repeat of a request whose prompt is a whole number of blocks (vLLM recomputes the last
prompt token, so it recomputes and re-stores that last block), requests that generate 40
tokens (``ignore_eos``) so that generated tokens fill blocks, and a long request that
forces evictions in the 64-block pool, after which earlier conversations come back.

Compared on every request, and required to be equal:

* ``usage.prompt_tokens``, ``usage.completion_tokens`` and
  ``usage.prompt_tokens_details.cached_tokens``;
* the sequence of KV events the request caused, in order: ``BlockStored`` blocks,
  ``BlockRemoved`` blocks and ``AllBlocksCleared``, with each block identified by its
  content, not by the engine's hash (the two engines hash differently):

  - a block made only of prompt tokens is identified by kvroute's key of that block
    (``Prompt.block_keys``: its tokens, the whole prefix before it, and the salt); the
    test also checks that the tokens each engine publishes for it are the prompt's;
  - a block that contains generated tokens is identified by *(request number, block
    position)*, and only its prompt part is checked token by token.  This is the one
    figure compared instead of content: the two engines generate different text (vLLM
    samples from random weights, the simulator emits its own tokens), so those blocks
    cannot have equal content.  Their count, position, eviction order and the fact
    that they never produce a hit are compared exactly.  The conversation history of
    later turns is scripted (fixed assistant text), as the history is what a client
    sends back and what matters for caching.
  - A removed block is identified by the identity its engine hash was stored with.

Batch boundaries (engine steps) are not compared: the two schedulers may split a
request's events into steps differently without a router being able to tell.

The trace starts from an empty cache: ``POST /reset_prefix_cache`` on both idle engines,
compared as an entry of its own ("reset (idle)": the events a router sees between the
reset and the first request).  vLLM 0.32 publishes nothing there: the block pool's
``AllBlocksCleared`` is taken and published only after the next engine step, so it
arrives as the first event of the first request's batch.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_fleet import EventTap, VllmReplica, log_tail

from index.events import ClearedEvent, RemovedEvent, StoredEvent
from kvkeys.types import EngineKey
from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry
from tests.ports import free_port

pytestmark = pytest.mark.e2e

GEN_TOKENS = 40

_WORDS = (
    "freight parcel depot route invoice customs pallet driver window schedule weight "
    "volume carrier tracking label manifest warehouse dock trailer container harbour "
    "rail airport courier express standard economy insurance claim refund damage delay "
    "weather storm holiday weekend morning evening north south east west city village "
    "address postcode signature photo scan barcode system update notice policy form fee"
).split()


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    # Sentences and line breaks so the template and pre-tokenizer see real structure.
    out = []
    for i, w in enumerate(words):
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += ".\n" if i % 36 == 35 else "."
    return " ".join(out)


SYS_A = "You are Dispatch, the assistant of a freight company.\n" + _text(1, 60)
SYS_B = "You are Ledger, the billing assistant.\n" + _text(2, 60)


def _conversation(system: str, seed: int, turns: int) -> list[list[dict[str, str]]]:
    """The successive request histories of a conversation with scripted replies."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        msgs = [*msgs, {"role": "user", "content": _text(seed * 100 + t, 14)}]
        out.append(msgs)
        msgs = [*msgs, {"role": "assistant", "content": _text(seed * 100 + 50 + t, 10)}]
    return out


@dataclass(frozen=True, slots=True)
class Step:
    """One request of the trace."""

    name: str
    messages: list[dict[str, str]]
    salt: str | None
    max_tokens: int


def _trace(registry: RendererRegistry, model: str, block_size: int) -> list[Step]:
    a = _conversation(SYS_A, 10, 4)  # conversations A and C share SYS_A, unsalted
    c = _conversation(SYS_A, 11, 3)
    b = _conversation(SYS_B, 12, 3)  # B and D share SYS_B under salt t1
    d = _conversation(SYS_B, 13, 2)
    e = _conversation(SYS_B, 14, 1)  # E: SYS_B under another salt: shares nothing
    filler = [[{"role": "user", "content": _text(99, 200)}]]

    # A prompt of exactly k blocks: pad the user text until the length is a multiple.
    pad = ""
    for _ in range(200):
        msgs = [{"role": "system", "content": SYS_A},
                {"role": "user", "content": "Exact blocks please." + pad}]
        n = registry.render_chat({"model": model, "messages": msgs}).num_tokens
        if n % block_size == 0:
            break
        pad += " x"
    else:
        raise AssertionError("could not build a prompt of whole blocks")
    exact = msgs

    g = GEN_TOKENS
    return [
        Step("A1", a[0], None, 1),
        Step("B1", b[0], "t1", 1),
        Step("C1", c[0], None, 1),  # hits A1's system-prompt blocks
        Step("A2", a[1], None, g),  # generated tokens fill blocks
        Step("D1", d[0], "t1", 1),  # hits B1's salted system prompt
        Step("E1", e[0], "t2", 1),  # same text as B/D, other salt: no hit
        Step("X1", exact, None, 1),
        Step("X1-again", exact, None, 1),  # full hit but the last block is recomputed
        Step("B2", b[1], "t1", g),
        Step("C2", c[1], None, 1),
        Step("F1", filler[0], None, 1),  # long: evicts the least recently used blocks
        Step("A3", a[2], None, 1),  # comes back after evictions
        Step("B3", b[2], "t1", 1),
        Step("D2", d[1], "t1", g),
        Step("C3", c[2], None, 1),
        Step("A4", a[3], None, 1),
        Step("F1-again", filler[0], None, 1),
        Step("A4-again", a[3], None, 1),
    ]


Identity = tuple[Any, ...]


@dataclass
class Observed:
    """What one engine did for one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    events: list[tuple[str, Identity]]


class _Labeller:
    """Turns one engine's events into content identities (per engine: hashes differ)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.position: dict[EngineKey, int] = {}
        self.identity: dict[EngineKey, Identity] = {}

    def label(
        self, events: list[Any], step_no: int, prompt: Prompt, engine: str
    ) -> list[tuple[str, Identity]]:
        out: list[tuple[str, Identity]] = []
        bs, n = self.bs, prompt.num_tokens
        for ev in events:
            if isinstance(ev, ClearedEvent):
                out.append(("cleared", ("all",)))
                self.position.clear()
                self.identity.clear()
            elif isinstance(ev, RemovedEvent):
                for h in ev.block_hashes:
                    out.append(("removed", self.identity.get(h, ("unknown", engine, h))))
            elif isinstance(ev, StoredEvent):
                parent = ev.parent_block_hash
                j = 0 if parent is None else self.position[parent] + 1
                for i, h in enumerate(ev.block_hashes):
                    toks = ev.token_ids[i * bs : (i + 1) * bs]
                    lo = (j + i) * bs
                    if lo + bs <= n:
                        assert toks == prompt.token_ids[lo : lo + bs], (
                            f"{engine}: stored block {j + i} of request {step_no} is not "
                            "the prompt's"
                        )
                        ident: Identity = ("prompt", prompt.block_keys[j + i])
                    else:
                        assert toks[: max(n - lo, 0)] == prompt.token_ids[lo:], (
                            f"{engine}: block {j + i} of request {step_no} does not start "
                            "with the prompt's tail"
                        )
                        ident = ("generated", step_no, j + i)
                    self.position[h] = j + i
                    self.identity[h] = ident
                    out.append(("stored", ident))
        return out


def _run_trace(
    url: str,
    tap: EventTap,
    trace: list[Step],
    prompts: list[Prompt],
    model: str,
    block_size: int,
    engine: str,
) -> list[Observed]:
    labeller = _Labeller(block_size)
    observed: list[Observed] = []
    with httpx.Client(base_url=url, timeout=120.0) as client:
        # The reset, on an idle engine, is an entry of its own: what a router sees
        # between the reset and the first request.
        mark = tap.mark()
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200, r.text
        tap.settle()
        events = [e for b in tap.since(mark) for e in b.batch.events]
        mark = tap.mark()
        observed.append(Observed(0, 0, 0, labeller.label(events, -1, prompts[0], engine)))
        for no, (step, prompt) in enumerate(zip(trace, prompts, strict=True)):
            body: dict[str, Any] = {
                "model": model,
                "messages": step.messages,
                "max_tokens": step.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            if step.salt is not None:
                body["cache_salt"] = step.salt
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, f"{engine} {step.name}: {r.text}"
            tap.settle()
            usage = r.json()["usage"]
            events = [e for b in tap.since(mark) for e in b.batch.events]
            mark = tap.mark()
            observed.append(
                Observed(
                    prompt_tokens=usage["prompt_tokens"],
                    completion_tokens=usage["completion_tokens"],
                    cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                    events=labeller.label(events, no, prompt, engine),
                )
            )
    return observed


@contextlib.contextmanager
def sim_process(
    *, model: str, tokenizer: Path, block_size: int, num_blocks: int, max_model_len: int,
    log_path: Path,
) -> Iterator[tuple[str, str, str]]:
    """Run ``kvroute sim`` (this checkout) in a process; yields (url, events, replay)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvroute.cli", "sim",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--tokenizer", str(tokenizer),
        "--block-size", str(block_size), "--num-blocks", str(num_blocks),
        "--max-model-len", str(max_model_len),
        "--time-scale", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        sources: dict[str, Any] | None = None
        while sources is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvroute sim did not start:\n{log_tail(log_path)}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    sources = httpx.get(url + "/kv_event_sources", timeout=5.0).json()
            except httpx.HTTPError:
                time.sleep(0.2)
        cfg = sources["0"]
        yield url, cfg["endpoint"], cfg["replay_endpoint"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def sim_replica(
    vllm_replica: VllmReplica, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    """A ``kvroute sim`` process configured like ``vllm_replica``: (url, events, replay)."""
    with sim_process(
        model=vllm_replica.served_model_name,
        tokenizer=vllm_replica.model_dir,
        block_size=vllm_replica.block_size,
        num_blocks=vllm_replica.num_gpu_blocks,
        max_model_len=vllm_replica.spec.max_model_len or 2048,
        log_path=tmp_path_factory.mktemp("sim") / "sim.log",
    ) as sim:
        yield sim


def _describe(name: str, v: Observed, s: Observed) -> str:
    lines = [f"request {name}:"]
    for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if getattr(v, field) != getattr(s, field):
            lines.append(f"  {field}: vLLM {getattr(v, field)} != sim {getattr(s, field)}")
    if v.events != s.events:
        width = max(len(v.events), len(s.events))
        for i in range(width):
            ve = v.events[i] if i < len(v.events) else None
            se = s.events[i] if i < len(s.events) else None
            mark = "  " if ve == se else "!="
            lines.append(f"  {i:3} {mark} vLLM {ve}   sim {se}")
    return "\n".join(lines)


def test_sim_matches_vllm_on_a_multi_turn_trace(
    vllm_replica: VllmReplica, sim_replica: tuple[str, str, str]
) -> None:
    mismatches = compare(vllm_replica, sim_replica)
    assert not mismatches, "the simulator diverges from vLLM:\n" + "\n".join(mismatches)


def compare(vllm_replica: VllmReplica, sim_replica: tuple[str, str, str]) -> list[str]:
    """Run the trace on both; check the trace does what it claims on vLLM; return the
    per-request differences (empty when the simulator agrees everywhere)."""
    model, bs = vllm_replica.served_model_name, vllm_replica.block_size
    registry = RendererRegistry(
        [ModelSpec(name=model, block_size=bs, tokenizer=vllm_replica.model_dir,
                   max_model_len=vllm_replica.spec.max_model_len)]
    )
    trace = _trace(registry, model, bs)
    prompts = [
        registry.render_chat({"model": model, "messages": s.messages, "cache_salt": s.salt})
        for s in trace
    ]

    # The pool both engines get: vLLM reports the override, null block included.
    metrics = httpx.get(vllm_replica.url + "/metrics", timeout=10.0).text
    assert f'num_gpu_blocks="{vllm_replica.num_gpu_blocks}"' in metrics

    with EventTap(vllm_replica.events_endpoint, vllm_replica.replay_endpoint) as tap:
        real = _run_trace(vllm_replica.url, tap, trace, prompts, model, bs, "vLLM")
    sim_url, sim_events, sim_replay = sim_replica
    with EventTap(sim_events, sim_replay) as tap:
        sim = _run_trace(sim_url, tap, trace, prompts, model, bs, "sim")

    # The trace exercises what it claims to (on the real engine).
    names = ["reset (idle)", *(s.name for s in trace)]
    by_name = dict(zip(names, real, strict=True))
    # vLLM takes the pool's events only after an engine step: on an idle engine the
    # reset is published with the first request's batch, not before.
    assert by_name["reset (idle)"].events == []
    assert by_name["A1"].events[0] == ("cleared", ("all",))
    assert by_name["C1"].cached_tokens > 0 and by_name["D1"].cached_tokens > 0
    assert by_name["E1"].cached_tokens == 0
    x = by_name["X1-again"]
    assert x.cached_tokens == by_name["X1"].prompt_tokens - bs
    assert any(kind == "removed" for o in real for kind, _ in o.events), "no eviction"
    assert any(ident[0] == "generated" for o in real for _, ident in o.events)
    assert all(o.prompt_tokens == p.num_tokens for o, p in zip(real[1:], prompts, strict=True))

    return [
        _describe(name, v, s) for name, v, s in zip(names, real, sim, strict=True) if v != s
    ]

