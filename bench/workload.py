"""Multi-turn chat workloads: who arrives when, says what, and comes back after how long.

A workload is a set of conversations (sessions).  Each session belongs to a tenant, starts
at a Poisson arrival time, has a system prompt (shared by everyone, one per tenant, or
unique to the session), and a number of turns; each turn is a user message of a sampled
length, a reply budget (``max_tokens``) of a sampled length, and a think time the user
waits after the reply before sending the next turn.

Contracts:

* Deterministic: ``generate(spec)`` depends only on ``spec`` (its ``seed`` included);
  the same spec gives the same trace, byte for byte once saved (``bench.trace``).
* Lengths are in tokens, converted to words with ``spec.tokens_per_word`` (about 1.0 for
  the common English words used here with real BPE tokenizers; measure it for a tokenizer
  with ``tokens_per_word(encode)`` and pass it in when exact lengths matter).
* Every session's text is drawn from the seeded generator, so two sessions share a prefix
  only through their system prompt, which is what the sharing mode controls.
* Tenants with ``salted=True`` send a per-tenant ``cache_salt`` (vLLM folds it into block
  0), so tenants never share cache even with the same system prompt.

What it does not do: talk to any server (``bench.runner`` replays), or decide replies
(the trace carries a fixed reply text per turn; the runner may use the real one).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from bench.trace import TraceRequest

DistKind = Literal["fixed", "uniform", "lognormal", "exponential"]
Sharing = Literal["shared", "tenant", "unique"]

# Plain, frequent English words: each is one token for Llama-3/Qwen-style BPEs.
_WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    """the of and to in is was for on that with as by at from his her it an were are which
    this be or has had not but one their its first new after two who they have been other
    all more most also when there she time can into year out about over than only some him
    many may up would these three then made where used between world during part under city
    while known well number them because both before each day through through house name
    work left place such high called water long much same back found great people later
    state best small early point life large near main line area good end war still field way
    game next system family group report based power music season team show book road case
    order form light river story side open home local market course play level model press
    line plan price data city value study test note page hand paper rate role food cost
    heart voice word form range table sound change cause door issue piece room plant style
    stone trade track train truth unit view wall wave wind window winter wood yard young
    answer begin build carry clear close cover cross draw drive enjoy explain fill finish
    follow gather grow guide hold join keep learn lift listen match measure move offer pass
    plan pull reach read return run save serve share sign speak stand start stay study take
    teach travel turn visit wait walk watch write quiet quick bright calm early fair final
    fresh full green heavy huge kind late little loud modern narrow plain proud rapid rich
    ripe round sharp short simple slow smooth soft solid strong sweet tall thick thin tiny
    warm wide wild wise""".split()
))

WORDS: tuple[str, ...] = _WORDS
"""The vocabulary of generated text (also what imported block-hash traces are written in)."""

PRESETS: tuple[str, ...] = ("main", "small", "shared", "unique")
"""Names accepted by ``preset``."""


@dataclass(frozen=True, slots=True)
class Dist:
    """A non-negative number distribution, clipped to ``[lo, hi]``.

    ``fixed``: always ``a``.  ``uniform``: between ``a`` and ``b``.  ``lognormal``:
    median ``a``, log-space standard deviation ``b``.  ``exponential``: mean ``a``.
    """

    kind: DistKind
    a: float
    b: float = 0.0
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0:
            raise ValueError(f"distribution parameters must be >= 0: {self}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform needs a <= b: {self}")
        if self.lo > self.hi:
            raise ValueError(f"lo must be <= hi: {self}")

    def sample(self, rng: random.Random) -> float:
        """One draw, clipped."""
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "lognormal":
            x = self.a * math.exp(rng.gauss(0.0, self.b)) if self.a > 0 else 0.0
        else:
            x = rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return min(max(x, self.lo), self.hi)

    def sample_int(self, rng: random.Random) -> int:
        """One draw rounded to a whole count (at least 1 unless the distribution is 0)."""
        x = self.sample(rng)
        return max(int(round(x)), 1 if x > 0 else 0)

    def mean(self) -> float:
        """The mean before clipping."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a

    @classmethod
    def parse(cls, text: str) -> Dist:
        """``"350"``, ``"fixed:350"``, ``"uniform:100,200"``, ``"lognormal:150,0.3"``,
        ``"exponential:20"``."""
        kind, _, params = text.partition(":")
        if not params:
            return cls("fixed", float(kind))
        values = [float(p) for p in params.split(",")]
        if kind not in ("fixed", "uniform", "lognormal", "exponential"):
            raise ValueError(f"unknown distribution {kind!r} in {text!r}")
        return cls(kind, *values[:2])  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ThinkTime:
    """Seconds a user waits after a reply: a body distribution plus a share of users who
    come back much later (the tail that outlives the cache)."""

    body: Dist = Dist("lognormal", 15.0, 0.6, hi=600.0)
    tail: Dist = Dist("lognormal", 240.0, 0.4, hi=1800.0)
    tail_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.tail_share <= 1.0:
            raise ValueError(f"tail_share must be within [0, 1], got {self.tail_share}")

    def sample(self, rng: random.Random) -> float:
        """One think time in seconds (one uniform draw picks body or tail, then one draw)."""
        return (self.tail if rng.random() < self.tail_share else self.body).sample(rng)

    def mean(self) -> float:
        """The mean before clipping."""
        return (1 - self.tail_share) * self.body.mean() + self.tail_share * self.tail.mean()

    def scaled(self, factor: float) -> ThinkTime:
        """The same shape with every duration multiplied by ``factor``."""

        def scale(d: Dist) -> Dist:
            return replace(d, a=d.a * factor, b=d.b * factor if d.kind == "uniform" else d.b,
                           lo=d.lo * factor, hi=d.hi * factor)

        return ThinkTime(scale(self.body), scale(self.tail), self.tail_share)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Everything that determines a trace."""

    sessions: int = 64
    """Number of conversations."""
    arrival_rate: float = 1.0
    """Poisson arrivals of new conversations, per second."""
    turns: Dist = Dist("fixed", 10)
    system_tokens: Dist = Dist("fixed", 1500)
    sharing: Sharing = "tenant"
    """System prompt: one for all, one per tenant, or one per session."""
    user_tokens: Dist = Dist("fixed", 150)
    reply_tokens: Dist = Dist("fixed", 350)
    """The reply budget per turn, sent as ``max_tokens``."""
    think: ThinkTime = field(default_factory=ThinkTime)
    tenants: int = 1
    salted: bool = False
    """Give each tenant its own ``cache_salt``."""
    model: str | None = None
    """Model name to put in requests (``None``: the runner's default)."""
    tokens_per_word: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.tenants < 1:
            raise ValueError("sessions must be >= 0 and tenants >= 1")
        if self.arrival_rate <= 0 or self.tokens_per_word <= 0:
            raise ValueError("arrival_rate and tokens_per_word must be > 0")


def preset(name: str, **overrides: object) -> WorkloadSpec:
    """A named workload, with fields overridden by keyword.

    * ``main``: the main example's shape, a 1,500-token system prompt per tenant, 150-token
      user turns, 350-token replies, 10 turns, log-normal think time with a 10% tail.
    * ``small``: the same shape scaled down (300/40/60 tokens, 6 turns) for demos and tests.
    * ``shared``: ``main`` with one system prompt for every user (the hotspot case).
    * ``unique``: ``main`` with a system prompt per user.
    """
    base: dict[str, object]
    if name == "main":
        base = {}
    elif name == "shared":
        base = {"sharing": "shared"}
    elif name == "unique":
        base = {"sharing": "unique"}
    elif name == "small":
        base = {
            "system_tokens": Dist("fixed", 300),
            "user_tokens": Dist("lognormal", 40, 0.3, lo=8, hi=160),
            "reply_tokens": Dist("lognormal", 60, 0.3, lo=8, hi=240),
            "turns": Dist("fixed", 6),
        }
    else:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    base.update(overrides)
    return WorkloadSpec(**base)  # type: ignore[arg-type]


def words(rng: random.Random, n_tokens: int, tokens_per_word: float) -> str:
    """About ``n_tokens`` tokens of text: seeded random words, a full stop every ~12."""
    n = max(int(round(n_tokens / tokens_per_word)), 1 if n_tokens > 0 else 0)
    out: list[str] = []
    for i in range(n):
        w = rng.choice(_WORDS)
        out.append(w + "." if i % 12 == 11 else w)
    return " ".join(out)


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """The trace of ``spec``: every turn of every session, ordered by nominal time.

    ``at`` of turn 1 is the session's Poisson arrival; ``at`` of later turns is nominal
    (previous ``at`` plus the think time, service time excluded): the runner sends turn
    N+1 ``think_s`` after turn N's reply, whatever the service took.
    """
    rng = random.Random(spec.seed)
    tpw = spec.tokens_per_word
    tenants = [f"t{i}" for i in range(spec.tenants)]
    salts = {t: f"salt-{t}-{spec.seed}" if spec.salted else None for t in tenants}
    shared_prompt = words(rng, spec.system_tokens.sample_int(rng), tpw)
    tenant_prompts = {
        t: f"You are the assistant of tenant {t}. "
        + words(rng, spec.system_tokens.sample_int(rng), tpw)
        for t in tenants
    }
    out: list[TraceRequest] = []
    clock = 0.0
    width = max(len(str(spec.sessions)), 4)
    for s in range(spec.sessions):
        clock += rng.expovariate(spec.arrival_rate)
        session = f"s{s:0{width}d}"
        tenant = tenants[s % len(tenants)]
        if spec.sharing == "shared":
            system = shared_prompt
        elif spec.sharing == "tenant":
            system = tenant_prompts[tenant]
        else:
            system = f"Session {session}. " + words(rng, spec.system_tokens.sample_int(rng), tpw)
        n_turns = max(spec.turns.sample_int(rng), 1)
        at = clock
        for turn in range(1, n_turns + 1):
            think = 0.0 if turn == 1 else spec.think.sample(rng)
            at += think
            max_tokens = max(spec.reply_tokens.sample_int(rng), 1)
            out.append(
                TraceRequest(
                    session=session,
                    turn=turn,
                    at=round(at, 6),
                    think_s=round(think, 6),
                    user=words(rng, spec.user_tokens.sample_int(rng), tpw),
                    max_tokens=max_tokens,
                    system=system if turn == 1 else None,
                    reply=words(rng, max_tokens, tpw),
                    tenant=tenant,
                    cache_salt=salts[tenant],
                    model=spec.model,
                )
            )
    out.sort(key=lambda r: (r.at, r.session, r.turn))
    return out


def summarize(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts and means of a trace (for reports and tests)."""
    sessions = {r.session for r in trace}
    later = [r.think_s for r in trace if r.turn > 1]
    starts = sorted(r.at for r in trace if r.turn == 1)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return {
        "requests": float(len(trace)),
        "sessions": float(len(sessions)),
        "turns_mean": len(trace) / len(sessions) if sessions else 0.0,
        "think_mean_s": sum(later) / len(later) if later else 0.0,
        "arrival_gap_mean_s": sum(gaps) / len(gaps) if gaps else 0.0,
        "span_s": max((r.at for r in trace), default=0.0),
    }


def tokens_per_word(encode: Callable[[str], Sequence[int]], *, seed: int = 0) -> float:
    """Tokens per generated word for a tokenizer (``encode`` text -> ids), measured on a
    2,000-word sample of this module's text."""
    sample = words(random.Random(seed), 2000, 1.0)
    return max(len(encode(" " + sample)) / 2000, 0.05)


def measure_tokens_per_word(tokenizer_dir: Path) -> float:
    """``tokens_per_word`` for the ``tokenizer.json`` in ``tokenizer_dir`` (blocking)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tokens_per_word(lambda s: tok.encode(s, add_special_tokens=False).ids)
