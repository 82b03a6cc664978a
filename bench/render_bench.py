"""Render + tokenise + hash benchmark: cold and warm turns of a long conversation.

``python -m bench.render_bench [--tokenizer DIR] [--block-size 16] [--turns 5,10,20,30,40]``

The conversation has the shape of the main example: a 1,500-token system prompt, then
turns of a 150-token user message and a 350-token assistant reply (token counts under
the tokenizer used; the default is the tiny Llama-3-style tokenizer, built with
``python -m replica.vllm.tiny_tokenizer`` in a temporary directory).  The prompt of turn N
holds N user messages and N-1 replies: 10 turns are 1,500 + 10*150 + 9*350 = 6,150
content tokens (plus the template's own tokens).

For each turn count N it measures ``RendererRegistry.render_chat`` (template, cached
tokenisation, incremental block keys) on the prompt of turn N.  Every request body is
a fresh parse of its JSON (new dicts and strings, as the router's parser hands them
over), made before the clock starts:

* cold: every cache emptied first (the remembered turns, the pieces' and words' ids,
  the key trie);
* warm: turn N after the router followed the conversation: caches emptied, then turns
  1 .. N-1 rendered one after the other (untimed), then turn N timed.  The caches are
  as a router has them when the next turn of a conversation arrives (no earlier prompt
  is held: the router drops a prompt when its request is done), and only the new reply
  and user message are rendered, tokenised and hashed;
* warm after a cold N-1 (``cold_prev``): the same turn N right after turn N-1 was
  rendered cold into emptied caches.  The caches end up the same, but that cold
  rendering sweeps a memory footprint that grows with N through the CPU caches just
  before the timed turn, so this figure grows with N even where the turn's own work
  does not (the instruction count of the timed turn is the same either way);
* prewarmed: turn N when the router called ``prewarm_reply`` with turn N-1's reply
  after relaying it (the client's think time), so only the new user message is new.

Each figure is the median (and p90) of ``--reps`` runs, in CPU time of the measuring
thread (``time.thread_time``: all the work is on that thread) and in wall-clock time.
Every run measures each turn count in turn, so a change in the machine's speed during
the benchmark shifts all rows alike instead of one.
On a shared machine the wall clock also counts time the process waited for a core, so
CPU time is the cost figure; the JSON records the load average at start and end.
Phases of the warm turn are timed separately, as ``render_chat`` runs them (render =
messages to text, ``ModelRenderer.chat_text``; tokenise = split and cached encoding,
``tokenize_text``; hash = block keys, ``PromptKeyer.keys``).  It prints a table and
writes JSON (``--json``).
"""


from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prompt.keyer import Prompt
from prompt.registry import ModelSpec, RendererRegistry, Target

SYSTEM_TOKENS = 1500
USER_TOKENS = 150
REPLY_TOKENS = 350

_SYLLABLES = "ka ro mi te su na lo vi pe da ge ri bo zu an en in on un ar er or".split()
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "cache block token prefix router replica request model hello world please thanks"
).split()


def build_default_tokenizer(out: Path) -> Path:
    """The tiny Llama-3-style tokenizer, built by the replica package's CLI (bench may
    not import ``replica``)."""
    subprocess.run(
        [sys.executable, "-m", "replica.vllm.tiny_tokenizer", str(out), "--template", "llama3"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


class TextMaker:
    """Deterministic text of an exact token count (content only, no template)."""

    def __init__(self, count_tokens: Callable[[str], int], seed: int = 0) -> None:
        self._count = count_tokens
        self._rng = random.Random(seed)
        self._by_len: dict[int, list[str]] = {}
        for w in _WORDS:
            self._by_len.setdefault(count_tokens(" " + w), []).append(w)

    def _word(self) -> str:
        if self._rng.random() < 0.7:
            return self._rng.choice(_WORDS)
        return "".join(self._rng.choice(_SYLLABLES) for _ in range(self._rng.randint(1, 3)))

    def text(self, tokens: int) -> str:
        words: list[str] = [self._word()]
        while self._count(" ".join(words)) < tokens - 6:
            words.append(self._word())
        text = " ".join(words)
        singles = self._by_len.get(1, ["the"])
        while (n := self._count(text)) < tokens:
            text += " " + self._rng.choice(singles)
        while n > tokens:
            text = text.rsplit(" ", 1)[0]
            n = self._count(text)
            while n < tokens:
                text += " " + self._rng.choice(singles)
                n = self._count(text)
        return text


def conversation(maker: TextMaker, turns: int) -> list[dict[str, str]]:
    """System prompt, then ``turns`` user messages and ``turns - 1`` replies."""
    messages = [{"role": "system", "content": maker.text(SYSTEM_TOKENS)}]
    for i in range(turns):
        messages.append({"role": "user", "content": maker.text(USER_TOKENS)})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": maker.text(REPLY_TOKENS)})
    return messages


def _stats(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1e3,
        "min_ms": ordered[0] * 1e3,
    }


def _reset(registry: RendererRegistry, target: Target) -> None:
    assert target.renderer is not None
    target.renderer.turns.clear()
    target.renderer.encoder.clear()
    registry.keyer.clear()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _parsed(body: dict[str, Any]) -> dict[str, Any]:
    """A new request's objects, as the router's JSON parser produces them."""
    parsed: dict[str, Any] = json.loads(json.dumps(body))
    return parsed


def _follow(
    registry: RendererRegistry, target: Target, model: str, messages: list[dict[str, str]]
) -> Prompt:
    """Empty the caches, then render turns 1 .. N-1 of ``messages`` (turn N's), one
    after the other, as the router does when it follows the conversation; turn N-1's
    prompt."""
    _reset(registry, target)
    prompt = None
    for end in range(2, len(messages) - 1, 2):
        prompt = registry.render_chat(_parsed({"model": model, "messages": messages[:end]}))
    assert prompt is not None
    return prompt


_SAMPLES = (
    "cold",
    "cold_cpu",
    "warm",
    "warm_cpu",
    "render",
    "tokenise",
    "hash",
    "cold_prev_cpu",
    "prewarmed_cpu",
)


class Series:
    """The samples of one turn count: the last turn of ``messages``."""

    def __init__(
        self, registry: RendererRegistry, model: str, messages: list[dict[str, str]]
    ) -> None:
        self.registry = registry
        self.model = model
        self.messages = messages
        self.target = registry.resolve(model)
        self.body = {"model": model, "messages": messages}
        self.previous = {"model": model, "messages": messages[:-2]} if len(messages) > 2 else None
        self.prompt = registry.render_chat(_parsed(self.body))
        self.new_tokens = self.prompt.num_tokens
        self.samples: dict[str, list[float]] = {k: [] for k in _SAMPLES}

    def sample(self) -> None:
        """One run of every measurement (the caller disables the garbage collector)."""
        registry, target, model, messages = self.registry, self.target, self.model, self.messages
        renderer = target.renderer
        assert renderer is not None
        samples = self.samples
        _reset(registry, target)
        self._timed("cold", "cold_cpu")
        previous = self.previous
        if previous is None:
            return
        before = _follow(registry, target, model, messages).num_tokens  # the prompt is dropped
        self.new_tokens = self.prompt.num_tokens - before
        self._timed("warm", "warm_cpu")
        # The same warm turn again, phase by phase.
        _follow(registry, target, model, messages)
        request = _parsed(self.body)
        t0 = time.thread_time()
        chat = renderer.chat_text(request)
        t1 = time.thread_time()
        tokenized = renderer.tokenize_text(chat)
        t2 = time.thread_time()
        assert tokenized.segments is not None
        ctx = target.key_context(None)
        registry.keyer.keys(ctx, tokenized.segments, resume=tokenized.key_resume)
        t3 = time.thread_time()
        samples["render"].append(t1 - t0)
        samples["tokenise"].append(t2 - t1)
        samples["hash"].append(t3 - t2)
        # Turn N right after turn N-1 was rendered cold into emptied caches.
        _reset(registry, target)
        registry.render_chat(_parsed(previous))
        self._timed(None, "cold_prev_cpu")
        # Turn N when the router pre-warmed turn N-1's reply while the client read it
        # (``prewarm_reply``): only the new user message is tokenised on the path.
        _follow(registry, target, model, messages)
        registry.prewarm_reply(_parsed(previous), messages[-2]["content"])
        self._timed(None, "prewarmed_cpu")

    def _timed(self, wall_key: str | None, cpu_key: str) -> None:
        """Render this turn's request (freshly parsed) and record its wall and CPU time."""
        request = _parsed(self.body)
        w0, c0 = _clock()
        self.registry.render_chat(request)
        w1, c1 = _clock()
        if wall_key is not None:
            self.samples[wall_key].append(w1 - w0)
        self.samples[cpu_key].append(c1 - c0)

    def row(self) -> dict[str, Any]:
        """The figures of this turn count, as the JSON's ``rows`` hold them."""
        samples = self.samples
        row: dict[str, Any] = {
            "turns": (len(self.messages) + 1) // 2,
            "prompt_tokens": self.prompt.num_tokens,
            "blocks": len(self.prompt.block_keys),
            "new_tokens_warm": self.new_tokens,
            "cold_wall": _stats(samples["cold"]),
            "cold_cpu": _stats(samples["cold_cpu"]),
        }
        if samples["warm"]:
            row["warm_wall"] = _stats(samples["warm"])
            row["warm_cpu"] = _stats(samples["warm_cpu"])
            row["warm_cpu_phases_median_ms"] = {
                k: statistics.median(samples[k]) * 1e3 for k in ("render", "tokenise", "hash")
            }
            row["warm_cpu_us_per_new_token"] = (
                row["warm_cpu"]["median_ms"] * 1e3 / max(self.new_tokens, 1)
            )
            row["warm_cold_prev_cpu"] = _stats(samples["cold_prev_cpu"])
            row["warm_prewarmed_cpu"] = _stats(samples["prewarmed_cpu"])
        return row


def run(
    tokenizer: Path, block_size: int, turn_counts: Sequence[int], reps: int, seed: int
) -> dict[str, Any]:
    """Every measurement, as the JSON document the CLI writes.

    Each rep measures every turn count in turn, so a change in the machine's speed
    during the run (another process, the host) lands on every row alike.
    """
    registry = RendererRegistry(
        [ModelSpec(name="bench", block_size=block_size, tokenizer=tokenizer)]
    )
    target = registry.resolve("bench")
    assert target.renderer is not None
    encoder = target.renderer.encoder
    maker = TextMaker(lambda s: len(encoder.encode_uncached(s)), seed=seed)
    longest = conversation(maker, max(turn_counts))
    load_start = os.getloadavg()
    series = [Series(registry, "bench", longest[: 2 * turns]) for turns in turn_counts]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            for one in series:
                one.sample()
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "tokenizer": str(tokenizer),
        "block_size": block_size,
        "reps": reps,
        "shape": {"system": SYSTEM_TOKENS, "user": USER_TOKENS, "reply": REPLY_TOKENS},
        "content_tokens_10_turns": SYSTEM_TOKENS + 10 * USER_TOKENS + 9 * REPLY_TOKENS,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "rows": [one.row() for one in series],
    }


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table (milliseconds; medians unless marked p90)."""
    nan = float("nan")
    lines = [
        f"render + tokenise + hash, block size {result['block_size']}, {result['reps']} reps, "
        f"load average {result['loadavg_start'][0]:.1f} on {result['cpu_count']} CPUs",
        f"{'':>20}{'---- cold ----':>18}{'-------- warm (turn N after N-1) --------':>54}"
        f"{'after cold N-1':>15}{'prewarmed':>10}",
        f"{'turns':>5} {'tokens':>7} {'new':>5} {'cpu':>8} {'wall':>8} {'cpu':>8} {'cpu p90':>8} "
        f"{'wall':>8} {'render':>7} {'tokenise':>8} {'hash':>6} {'us/new':>7} {'cpu':>14} "
        f"{'cpu':>9}",
    ]
    for row in result["rows"]:
        w_cpu = row.get("warm_cpu", {})
        w_wall = row.get("warm_wall", {})
        ph = row.get("warm_cpu_phases_median_ms", {})
        lines.append(
            f"{row['turns']:>5} {row['prompt_tokens']:>7} {row['new_tokens_warm']:>5} "
            f"{row['cold_cpu']['median_ms']:>8.2f} {row['cold_wall']['median_ms']:>8.2f} "
            f"{w_cpu.get('median_ms', nan):>8.3f} {w_cpu.get('p90_ms', nan):>8.3f} "
            f"{w_wall.get('median_ms', nan):>8.3f} {ph.get('render', nan):>7.3f} "
            f"{ph.get('tokenise', nan):>8.3f} {ph.get('hash', nan):>6.3f} "
            f"{row.get('warm_cpu_us_per_new_token', nan):>7.2f} "
            f"{row.get('warm_cold_prev_cpu', {}).get('median_ms', nan):>14.3f} "
            f"{row.get('warm_prewarmed_cpu', {}).get('median_ms', nan):>9.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: tiny llama3)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--turns", default="5,10,20,30,40")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    # Tokenise on this thread, as kvroute's own processes do (kvroute/cli.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    turn_counts = [int(t) for t in args.turns.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="render-bench-") as tmp:
        tokenizer = args.tokenizer or build_default_tokenizer(Path(tmp) / "tok")
        result = run(tokenizer, args.block_size, turn_counts, args.reps, args.seed)
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
