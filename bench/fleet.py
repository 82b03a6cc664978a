"""A simulated fleet (``kvroute sim`` replicas) and a router (``kvroute serve``), as child
processes of the benchmark, started and stopped as one unit.

``Fleet`` is an async context manager.  On entry it starts the replicas concurrently,
each on a free loopback port (the replica prints a JSON line with its URL), waits for
their ``/health``, then starts the router on a free port in front of them and waits for
``/ready`` and for every KV event source the router lists to be live (``wait_kv_live``).
On exit, for any reason (an error, ``Ctrl-C``, a cancelled task), it sends SIGTERM to
every process it started, waits for them briefly, and SIGKILLs the rest.
Each child runs in its own session (process group), and only those groups are signalled.

Children are ``sys.executable -m kvroute ...``: bench never imports ``router`` or
``replica``; they meet over HTTP as in production.  Each child's stdout and stderr go to
a log file in ``FleetSpec.log_dir`` (no pipes to fill up); the tail of the log is put in
the error when a child fails to start.

``build_tokenizer_dir`` makes the tiny test tokenizer (and model) the fleet needs through
``kvroute replica tiny-model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

START_TIMEOUT_S = 60.0
"""How long a child may take to come up (Python start-up on a busy 2-core box is slow)."""
STOP_TIMEOUT_S = 8.0
"""How long a child gets to exit after SIGTERM before SIGKILL."""


class FleetError(RuntimeError):
    """A fleet process failed to start or died."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """What to start."""

    tokenizer: Path
    replicas: int = 4
    model: str = "kvroute-demo"
    block_size: int = 16
    num_blocks: int | None = None
    """KV blocks per replica, the null block included (``None``: the profile's)."""
    time_scale: float = 1.0
    """Wall seconds per simulated second, for the replicas and the router's judgement
    clock alike (``RouterSettings.time_scale``)."""
    profile: str = "default"
    router: bool = True
    policy: str | None = None
    """The router's default policy (``None``: its own default)."""
    router_args: tuple[str, ...] = ()
    router_workers: int = 1
    """``kvroute serve --workers N``: the router's processes on its one port."""
    sim_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    clock_file: Path | None = None
    """A clock warp file (``aio.clock_warp``) the replicas and kvroute routers read, so a
    benchmark can skip the fleet's idle time (``bench.idle_skip``)."""
    wrap: tuple[str, ...] = ()
    """A command prefix for every child, e.g. ``("ip", "netns", "exec", "kvbench-1")``."""


@dataclass(slots=True)
class _Child:
    name: str
    proc: asyncio.subprocess.Process
    log: Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_kv_live(
    url: str, deadline: float, *, check: Callable[[], None] = lambda: None, workers: int = 1
) -> None:
    """Until ``/ready`` of the router at ``url`` shows every KV event source it lists as
    live (``kv_events.sources``; a router with none returns at once), or ``FleetError``
    at ``deadline`` (``time.monotonic()``).  ``check`` raises when the router died.

    A router takes traffic after ``scoring.startup_sync_s`` whether or not it has replayed
    the replicas' event history by then.  A fleet that served earlier targets holds up to
    ``buffer_steps`` batches per replica (those targets' runs and the reset after them),
    and on a busy machine their replay can outlast the sync window: the first turns of
    the next target would then route on an index still catching up.  Every target
    starts from an index in step with the replicas instead.

    With ``workers`` > 1 (``kvroute serve --workers N``: N processes on one port, each
    with its own index) every poll is a new connection, which the kernel gives to any of
    them, and the wait ends once each worker (``/ready``'s ``worker``) has answered with
    its sources live."""
    timeout = aiohttp.ClientTimeout(total=2.0)
    sources: dict[str, str] = {}
    live: set[int] = set()
    connector = aiohttp.TCPConnector(force_close=workers > 1)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        while True:
            check()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(url + "/ready") as resp:
                    body = await resp.json(content_type=None)
                kv = body.get("kv_events") if isinstance(body, dict) else None
                sources = (kv or {}).get("sources") or {}
                if all(state == "live" for state in sources.values()):
                    live.add(int(body.get("worker", 0)))
                    if len(live) >= workers:
                        return
            if time.monotonic() > deadline:
                raise FleetError(f"the router at {url} did not get its KV event sources "
                                 f"live in time (workers live: {sorted(live)} of "
                                 f"{workers}): {sources}")
            await asyncio.sleep(0.05)


def kvroute_command(*args: str) -> list[str]:
    """The command line of a ``kvroute`` subcommand run by this interpreter."""
    return [sys.executable, "-m", "kvroute", *args]


class Fleet:
    """Replicas plus a router, as child processes (see the module docstring)."""

    def __init__(self, spec: FleetSpec) -> None:
        if spec.replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self.spec = spec
        self.replica_urls: list[str] = []
        self.router_url: str | None = None
        self._children: list[_Child] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Where to send traffic: the router, or the only replica when there is no router."""
        if self.router_url is not None:
            return self.router_url
        return self.replica_urls[0]

    @property
    def pids(self) -> list[int]:
        """Process ids of the children still tracked."""
        return [c.proc.pid for c in self._children]

    async def __aenter__(self) -> Fleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _log_dir(self) -> Path:
        if self.spec.log_dir is not None:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
            return self.spec.log_dir
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-fleet-")
        return Path(self._tmp.name)

    async def _spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> _Child:
        log = self._log_dir() / f"{name}.log"
        with log.open("wb") as fh:
            proc = await asyncio.create_subprocess_exec(
                *self.spec.wrap, *argv,
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **self.spec.env, **(env or {})},
            )
        child = _Child(name, proc, log)
        self._children.append(child)
        return child

    async def start(self) -> None:
        """Start the replicas, then the router; returns once all are ready."""
        spec = self.spec
        sims = []
        for i in range(spec.replicas):
            # Port 0: the replica binds a port itself and prints its URL.  A port probed
            # here and bound later could be taken meanwhile by another replica's event
            # sockets, which bind ephemeral ports too.
            argv = kvroute_command(
                "sim", "--host", "127.0.0.1", "--port", "0",
                "--model", spec.model, "--tokenizer", str(spec.tokenizer),
                "--block-size", str(spec.block_size), "--time-scale", str(spec.time_scale),
                "--profile", spec.profile, "--seed", str(i), "--log-level", "WARNING",
                *(["--num-blocks", str(spec.num_blocks)] if spec.num_blocks else []),
                *(["--clock-file", str(spec.clock_file)] if spec.clock_file else []),
                *spec.sim_args,
            )
            sims.append(await self._spawn(f"replica{i}", argv))
        self.replica_urls = list(
            await asyncio.gather(*(self._wait_sim(c) for c in sims))
        )
        if spec.router:
            self.router_url, _ = await self._start_router(spec.policy, "router")

    async def _start_router(self, policy: str | None, name: str) -> tuple[str, _Child]:
        port = free_port()
        argv = kvroute_command(
            "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *[a for url in self.replica_urls for a in ("--replica", url)],
            *(["--policy", policy] if policy else []),
            *(["--workers", str(self.spec.router_workers)]
              if self.spec.router_workers > 1 else []),
            *self.spec.router_args,
        )
        # The router judges time in the replicas' time (``RouterSettings.time_scale``).
        env = {"KVROUTE_TIME_SCALE": str(self.spec.time_scale)}
        if self.spec.clock_file is not None:  # and its clock moves with theirs
            env["KVROUTE_CLOCK_FILE"] = str(self.spec.clock_file)
        child = await self._spawn(name, argv, env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        await self._wait_http(child, url + "/ready", deadline)
        await wait_kv_live(url, deadline, check=lambda: self._check_alive(child),
                           workers=self.spec.router_workers)
        return url, child

    @contextlib.asynccontextmanager
    async def router(self, policy: str | None = None) -> AsyncIterator[str]:
        """A router in front of this fleet's replicas for the duration of the block
        (yields its URL); stopped on exit.  Several may run one after another."""
        name = f"router-{policy or 'default'}"
        child: _Child | None = None
        try:
            url, child = await self._start_router(policy, name)
            yield url
        finally:
            stopping = [c for c in self._children if c.name == name]
            self._children = [c for c in self._children if c.name != name]
            if stopping:
                await asyncio.shield(_terminate(stopping))

    @contextlib.asynccontextmanager
    async def peer(
        self, name: str, command: Sequence[str], port: int, ready_path: str = "/health"
    ) -> AsyncIterator[str]:
        """A peer router (any command line, already filled in with its port and the
        replica URLs) for the duration of the block; yields its URL."""
        child_name = f"peer-{name}"
        try:
            child = await self._spawn(child_name, command)
            url = f"http://127.0.0.1:{port}"
            await self._wait_http(child, url + ready_path)
            yield url
        finally:
            stopping = [c for c in self._children if c.name == child_name]
            self._children = [c for c in self._children if c.name != child_name]
            if stopping:
                await asyncio.shield(_terminate(stopping))

    async def reset_caches(self, timeout_s: float = 30.0) -> None:
        """Empty every replica's prefix cache (``POST /reset_prefix_cache``), retrying
        while requests still hold blocks, so the next run starts from equal caches.

        As vLLM does, a replica publishes the reset (``AllBlocksCleared``) with its next
        engine step, so each then runs one step (a one-token prompt: no full block, so
        nothing is cached): a router started next replays the reset too, instead of
        routing its first requests on the previous run's blocks."""
        deadline = time.monotonic() + timeout_s
        step = {"model": self.spec.model, "prompt": "reset", "max_tokens": 1}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            for url in self.replica_urls:
                while True:
                    async with http.post(url + "/reset_prefix_cache") as resp:
                        if resp.status == 200:
                            break
                        if time.monotonic() > deadline:
                            raise FleetError(f"{url} would not reset its prefix cache "
                                             f"(HTTP {resp.status})")
                    await asyncio.sleep(0.1)
                async with http.post(url + "/v1/completions", json=step) as resp:
                    if resp.status != 200:
                        raise FleetError(f"{url} did not run a step after its reset "
                                         f"(HTTP {resp.status}: {(await resp.text())[:200]})")

    async def _wait_sim(self, child: _Child) -> str:
        """The URL a replica prints on its first stdout line, once it answers /health."""
        deadline = time.monotonic() + START_TIMEOUT_S
        url: str | None = None
        while url is None:
            self._check_alive(child)
            with contextlib.suppress(OSError, ValueError):
                for line in child.log.read_text(errors="replace").splitlines():
                    if line.startswith("{") and '"url"' in line:
                        url = str(json.loads(line)["url"])
                        break
            if url is None:
                if time.monotonic() > deadline:
                    raise FleetError(f"{child.name} did not start: {self._tail(child)}")
                await asyncio.sleep(0.05)
        await self._wait_http(child, url + "/health", deadline)
        return url

    async def _wait_http(self, child: _Child, url: str, deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + START_TIMEOUT_S
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                self._check_alive(child)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise FleetError(f"{child.name} not ready at {url}: {self._tail(child)}")
                await asyncio.sleep(0.05)

    def _check_alive(self, child: _Child) -> None:
        if child.proc.returncode is not None:
            raise FleetError(
                f"{child.name} exited with status {child.proc.returncode}: {self._tail(child)}"
            )

    @staticmethod
    def _tail(child: _Child, n: int = 1500) -> str:
        try:
            return child.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    async def stop(self) -> None:
        """Stop every child: SIGTERM, a grace period, then SIGKILL.  Idempotent, and safe
        to call from cancellation (it shields itself)."""
        children, self._children = self._children, []
        if children:
            await asyncio.shield(_terminate(children))
        self.router_url = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        # The child leads its own session (start_new_session): its group id is its pid.
        os.killpg(proc.pid, sig)


async def _terminate(children: Sequence[_Child]) -> None:
    for c in children:
        _signal_group(c.proc, signal.SIGTERM)
    waits = [asyncio.wait_for(c.proc.wait(), STOP_TIMEOUT_S) for c in children]
    results = await asyncio.gather(*waits, return_exceptions=True)
    for c, r in zip(children, results, strict=True):
        if isinstance(r, BaseException):
            _signal_group(c.proc, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.proc.wait(), STOP_TIMEOUT_S)


_BUILD_TOKENIZER = (
    "import sys; from replica.vllm.tiny_tokenizer import build_tokenizer; "
    "print(build_tokenizer(sys.argv[1], template=sys.argv[2]))"
)


async def _run_quiet(argv: Sequence[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), START_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, output.decode(errors="replace")


async def build_tokenizer_dir(out: Path, template: str = "llama3") -> Path:
    """The tiny test model directory (tokenizer + chat template) at ``out``, built once.

    Through ``kvroute replica tiny-model``; where that subcommand is not available, the
    tokenizer alone is built by ``replica.vllm.tiny_tokenizer`` in a child interpreter (bench
    never imports ``replica``)."""
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    code, output = await _run_quiet(
        kvroute_command("replica", "tiny-model", "--out", str(out), "--template", template)
    )
    if code != 0 and "invalid choice" in output:
        code, output = await _run_quiet([sys.executable, "-c", _BUILD_TOKENIZER, str(out),
                                         template])
    if code != 0:
        raise FleetError(f"building the tiny tokenizer failed: {output[-1500:]}")
    return out
