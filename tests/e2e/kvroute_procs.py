"""kvroute processes for the end-to-end tests: routers started as a user starts them.

``KvrouteProcess`` runs ``python -m kvroute.cli <argv>`` (the ``kvroute`` command) in its
own process group with its output in a log file, waits for an HTTP path to answer 200,
and stops it (SIGTERM, then SIGKILL).  ``router_config`` writes the YAML a deployment
would mount: the real vLLM replicas of the e2e fleet with their KV-event and replay
endpoints, and the Redis index.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from vllm_fleet import VllmReplica, free_port, log_tail


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
    config: dict[str, Any] = {
        "policy": policy,
        "log_level": "info",
        "replicas": [
            {
                "id": r.id,
                "url": r.url,
                "kv_events_endpoint": r.events_endpoint,
                "replay_endpoint": r.replay_endpoint,
            }
            for r in replicas
        ],
        "index": {"backend": "redis", "url": redis_url, "key_prefix": key_prefix},
        # Fast health hysteresis: a killed replica is out within ~1 s, a restarted one
        # back within ~1 s of answering.
        "health": {"interval_s": 0.5, "fails_to_down": 1, "successes_to_up": 1},
    }
    del tokenizer_dir  # the router reads the tokenizer from the replicas' model config
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
