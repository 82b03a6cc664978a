"""Replay a trace against any OpenAI-compatible endpoint, open loop, and record each request.

Open loop: turn 1 of a session is sent at its trace time ``at``, whatever else is going
on; turn N+1 is sent ``think_s`` after turn N's reply ended.  A slow system therefore sees
requests pile up (queueing shows in TTFT), and a slow reply delays the rest of its
conversation as it would delay a real user.  Trace times are multiplied by
``RunConfig.time_scale`` (wall seconds per trace second), so a trace of minutes replays
in seconds against a simulated fleet running at the same scale.

Replies (``RunConfig.replies``):

* ``"trace"`` (default): the next turn's history carries the trace's fixed reply.  Every
  policy, endpoint and run then sends byte-identical prompts, so results compare
  exactly and the cache bounds can be computed from the trace alone.  The simulated replica
  samples random tokens whose text does not re-encode to the same ids, so the real reply
  would not be reused from cache either.
* ``"actual"``: the history carries the text the endpoint returned, as a chat
  application does; use it against real engines to include reply caching.

Per request it records: the replica and reason (``x-kvroute-*`` headers when a kvroute
router is in front; else the simulated replica's own report, so peer routers' stickiness
shows too), the wall time to the first streamed chunk, the simulated TTFT when the
replica reports one (``usage.kvroute_sim.ttft_s``, asked for with ``sim_timing``), ``usage``
(``prompt_tokens``, ``prompt_tokens_details.cached_tokens``, via
``stream_options.include_usage``), and errors.  Requests that fail are recorded and the
conversation continues with the trace's reply.

Every request has a connect and a read timeout; the runner owns all its tasks (one
``TaskGroup``) and its one ``aiohttp.ClientSession``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from aio.clock_warp import ClockWarp
from bench.idle_skip import IdleSkipper
from bench.trace import TraceRequest, by_session, conversation

ReplyMode = Literal["trace", "actual"]


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How to replay a trace."""

    url: str
    """Base URL of the endpoint, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is added)."""
    model: str
    """Model for requests whose trace line names none."""
    time_scale: float = 1.0
    """Wall seconds per trace second (arrivals and think times are multiplied by it)."""
    replies: ReplyMode = "trace"
    stream: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra headers on every request (e.g. ``X-KVRoute-Policy``)."""
    session_header: str | None = "X-Session-ID"
    """Header that carries the session id (``None``: send none)."""
    send_user_field: bool = False
    """Also put the session id in the body's ``user`` field."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    """Longest gap between bytes of one response."""
    max_connections: int = 512
    temperature: float | None = 0.0
    max_tokens_cap: int | None = None
    """Cap the generated tokens per turn (the history still carries the trace's reply);
    TTFT, the figure compared, does not depend on it, and short generations keep a
    simulated benchmark within the CPU of a small machine."""
    sim_timing: bool = False
    """Ask a simulated replica for its simulated TTFT (``vllm_xargs.kvroute_sim_timing``)."""
    clock_file: Path | None = None
    """A clock warp file shared with the fleet (``aio.clock_warp``): the run skips the
    fleet's idle time (``bench.idle_skip``).  ``None``: wall time throughout."""

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What happened to one request."""

    session: str
    turn: int
    tenant: str | None
    scheduled_s: float
    """When it should have been sent (wall seconds since the run started, the idle time
    skipped included: ``bench.idle_skip``)."""
    sent_s: float
    status: int
    """HTTP status (0: no response)."""
    error: str | None = None
    ttft_s: float | None = None
    """Wall time from sending to the first streamed chunk (the whole response if not
    streaming)."""
    latency_s: float | None = None
    sim_ttft_s: float | None = None
    """TTFT in simulated seconds, as the simulated replica reports it."""
    replica: str | None = None
    reason: str | None = None
    predicted_cached_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the request succeeded."""
        return self.error is None and 200 <= self.status < 300

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


ProgressFn = Callable[[RequestResult], None]


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _usage_fields(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {}
    details = usage.get("prompt_tokens_details") or {}
    sim = usage.get("kvroute_sim") or {}
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens") if isinstance(details, Mapping) else None,
    }
    if isinstance(sim, Mapping) and isinstance(sim.get("ttft_s"), int | float):
        out["sim_ttft_s"] = float(sim["ttft_s"])
    if isinstance(sim, Mapping) and isinstance(sim.get("replica"), str):
        out["sim_replica"] = sim["replica"]
    return out


class Runner:
    """Replays traces through one HTTP client session (use as ``async with``)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self._http: aiohttp.ClientSession | None = None
        self._warp: ClockWarp | None = None
        self.clock = IdleSkipper()
        """The run's clock (wall time, plus the idle time skipped with a clock file)."""

    async def __aenter__(self) -> Runner:
        cfg = self.config
        if cfg.clock_file is not None:
            self._warp = ClockWarp.open(cfg.clock_file)
            self.clock = IdleSkipper(self._warp)
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_connections),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
            ),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._warp is not None:
            self._warp.close()
            self._warp = None
            self.clock = IdleSkipper()

    async def run(
        self, trace: Sequence[TraceRequest], progress: ProgressFn | None = None
    ) -> list[RequestResult]:
        """Replay ``trace`` open loop; results in completion order."""
        results: list[RequestResult] = []

        def done(r: RequestResult) -> None:
            results.append(r)
            if progress is not None:
                progress(r)

        t0 = self.clock.now()
        async with asyncio.TaskGroup() as outer:
            skipper = outer.create_task(self.clock.run())
            async with asyncio.TaskGroup() as tg:
                for turns in by_session(trace).values():
                    tg.create_task(self._session(turns, t0, done))
            skipper.cancel()
        return results

    async def _session(
        self, turns: list[TraceRequest], t0: float, done: ProgressFn
    ) -> None:
        scale = self.config.time_scale
        replies: list[str] = []
        use_actual = self.config.replies == "actual"
        messages_iter = conversation(turns, replies if use_actual else None)
        clock = self.clock
        due = t0 + turns[0].at * scale
        for turn, messages in zip(turns, messages_iter, strict=False):
            if turn.turn > turns[0].turn:
                due = clock.now() + turn.think_s * scale
            await clock.sleep_until(due)
            with clock.busy():
                result, text = await self.send(turn, messages, scheduled=due - t0, t0=t0)
            replies.append(text if result.ok else (turn.reply or ""))
            done(result)

    def body(self, turn: TraceRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The request body for one turn."""
        cfg = self.config
        body: dict[str, Any] = {
            "model": turn.model or cfg.model,
            "messages": messages,
            "max_tokens": min(turn.max_tokens, cfg.max_tokens_cap or turn.max_tokens),
            "stream": cfg.stream,
        }
        if cfg.sim_timing:
            body["vllm_xargs"] = {"kvroute_sim_timing": True}
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        if turn.cache_salt is not None:
            body["cache_salt"] = turn.cache_salt
        if cfg.send_user_field:
            body["user"] = turn.session
        return body

    async def send(
        self,
        turn: TraceRequest,
        messages: list[dict[str, Any]],
        *,
        scheduled: float = 0.0,
        t0: float | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[RequestResult, str]:
        """Send one turn; returns its result and the reply text."""
        if self._http is None:
            raise RuntimeError("Runner must be entered (async with) before use")
        cfg = self.config
        base = self.clock.now() if t0 is None else t0
        headers = {"Content-Type": "application/json", **cfg.headers, **(extra_headers or {})}
        if cfg.session_header:
            headers[cfg.session_header] = turn.session
        sent = self.clock.now()
        started = time.perf_counter()  # durations: no time is skipped while in flight
        common: dict[str, Any] = {
            "session": turn.session,
            "turn": turn.turn,
            "tenant": turn.tenant,
            "scheduled_s": round(scheduled, 6),
            "sent_s": round(sent - base, 6),
        }
        url = cfg.url.rstrip("/") + "/v1/chat/completions"
        try:
            async with self._http.post(
                url, data=json.dumps(self.body(turn, messages)), headers=headers
            ) as resp:
                meta: dict[str, Any] = {
                    "status": resp.status,
                    "replica": resp.headers.get("x-kvroute-replica"),
                    "reason": resp.headers.get("x-kvroute-reason"),
                    "predicted_cached_tokens": _int_header(
                        resp.headers, "x-kvroute-predicted-cached-tokens"
                    ),
                }
                if resp.status >= 400:
                    text = await resp.text()
                    return RequestResult(
                        **common, **meta, error=f"HTTP {resp.status}: {text[:200]}"
                    ), ""
                if cfg.stream:
                    ttft, usage, reply, err = await self._read_stream(resp, started)
                else:
                    payload = await resp.json()
                    ttft = time.perf_counter() - started
                    usage = payload.get("usage")
                    choices = payload.get("choices") or [{}]
                    reply = (choices[0].get("message") or {}).get("content") or ""
                    err = None
                latency = time.perf_counter() - started
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return RequestResult(
                **common, status=0, error=f"{type(exc).__name__}: {exc}"[:300]
            ), ""
        fields = _usage_fields(usage)
        sim_replica = fields.pop("sim_replica", None)
        if meta["replica"] is None and sim_replica is not None:
            meta["replica"] = sim_replica.removeprefix("http://")
        return RequestResult(
            **common,
            **meta,
            error=err,
            ttft_s=ttft,
            latency_s=latency,
            **fields,
        ), reply

    @staticmethod
    async def _read_stream(
        resp: aiohttp.ClientResponse, started: float
    ) -> tuple[float | None, dict[str, Any] | None, str, str | None]:
        ttft: float | None = None
        usage: dict[str, Any] | None = None
        parts: list[str] = []
        error: str | None = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = str(chunk["error"])[:300]
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if ttft is None:
                    ttft = time.perf_counter() - started
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    parts.append(delta["content"])
        return ttft, usage, "".join(parts), error
