"""``kvroute serve --workers 2``: two router processes on one port (SO_REUSEPORT) in front
of simulated replicas; both serve, the kv policy's predictions stay exact whichever
worker routes a turn, and SIGTERM shuts everything down cleanly (streams finish)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry

from bench.fleet import wait_kv_live
from replica.vllm.tiny_tokenizer import build_tokenizer
from tests.ports import free_port, free_ports
from tests.router.fake_replica import Behaviour, FakeReplica
from tests.router.helpers import chat, scrape
from tests.router.test_kv_integration import MODEL, Conversation, Fleet, Turn, send
from tests.router.test_membership_kv import sim


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


@contextmanager
def serve_workers(config: dict[str, Any], tmp_path: Path, port: int,
                  n: int = 2) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    kvroute = os.path.join(os.path.dirname(sys.executable), "kvroute")
    proc = subprocess.Popen(
        [kvroute, "serve", "--config", str(path), "--port", str(port), "--workers", str(n),
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes],
                admins: list[str]) -> None:  # fmt: skip
    deadline = time.monotonic() + 30
    pending = [url, *admins]
    while pending:
        assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()
        try:
            path = "/ready" if pending[0] == url else "/admin/replicas"
            async with http.get(pending[0] + path) as resp:
                if resp.status == 200:
                    pending.pop(0)
                    continue
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "kvroute serve --workers did not become ready"
        await asyncio.sleep(0.1)


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    t0 = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - t0 < timeout, "the supervisor did not exit"
        await asyncio.sleep(0.05)
    return proc.returncode


async def requests_served(http: aiohttp.ClientSession, admin: str) -> float:
    m = await scrape(http, admin)
    return sum(v for (name, _), v in m.items() if name == "router_requests_total")


def _meeting_places() -> set[Path]:
    """The directories supervisors made for their workers (``router.worker_peers``)."""
    return set(Path(tempfile.gettempdir()).glob("kvroute-workers-*"))


def children(pid: int) -> list[int]:
    """The worker processes of supervisor ``pid`` (not multiprocessing's helpers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return []
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(kid)
        except OSError:
            continue
    return out


async def test_two_workers_serve_keep_predictions_exact_and_stop_cleanly(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    tok = build_tokenizer(tmp_path / "tok", template="llama3")
    sims = [await stack.enter_async_context(sim(tok, i)) for i in range(3)]
    port = free_port()
    admin_port = free_ports(2, consecutive=True)[0]  # worker i listens on admin.port + i
    config = {
        "replicas": [{"url": s.url, "id": f"r{i}"} for i, s in enumerate(sims)],
        "policy": "kv",
        "health": {"interval_s": 0.2},
        "admin": {"enabled": True, "port": admin_port},
        "scoring": {"models": [{"name": MODEL, "block_size": 16, "tokenizer": str(tok)}],
                    "scrape": {"interval_s": 0.2}},
    }
    url = f"http://127.0.0.1:{port}"
    admins = [f"http://127.0.0.1:{admin_port + i}" for i in range(2)]
    # a connection per request: the kernel spreads them over both workers
    http = await stack.enter_async_context(aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        timeout=aiohttp.ClientTimeout(total=30)))
    before = _meeting_places()
    with serve_workers(config, tmp_path, port) as proc:
        await ready(http, url, proc, admins)
        assert len(children(proc.pid)) == 2
        f = Fleet([], url, http, CollectorRegistry(), None)  # type: ignore[arg-type]
        # each worker's /ready (``worker`` says which answered) lists its sources live
        await wait_kv_live(url, time.monotonic() + 30, workers=2)
        convs = [Conversation(system=f"Worker test {i}. " * 20, session=f"w{i}")
                 for i in range(6)]
        turns: list[Turn] = []

        async def talk(c: Conversation) -> None:
            for t in range(5):
                turns.append(await send(f, c, f"question {t} " + "explain " * 6,
                                        stream=t % 2 == 1, ask_usage=True))
                await asyncio.sleep(0.1)

        await asyncio.gather(*(talk(c) for c in convs))
        for i, admin in enumerate(admins):  # each worker's admin listener says which it is
            async with http.get(admin + "/admin/replicas") as resp:
                assert (await resp.json())["worker"] == i
        served = [await requests_served(http, a) for a in admins]
        assert all(n > 0 for n in served) and sum(served) == 30, served
        # each worker's look ahead hears of the other's requests (router.outlook_peers),
        # over sockets in a directory the supervisor made for them
        for admin in admins:
            m = await scrape(http, admin)
            assert m[("router_outlook_peer_messages_total", (("outcome", "applied"),))] > 0
            assert m[("router_outlook_peer_messages_total", (("outcome", "invalid"),))] == 0
        meeting = [p for p in _meeting_places() - before if any(p.glob("outlook-*"))]
        assert len(meeting) == 1
        later = [c.turns[i] for c in convs for i in range(1, 5)]
        # whichever worker routes a turn, it predicts what the replica then reports
        assert sum(t.predicted == t.cached for t in later) >= 0.95 * len(later), [
            [(t.replica, t.predicted, t.cached) for t in c.turns] for c in convs]
        # a later turn leaves its replica only as a deliberate load decision (the worker
        # that routes it knows where its cache is, whichever worker placed the turn before)
        moved = [c.turns[i] for c in convs for i in range(1, 5)
                 if c.turns[i].replica != c.turns[i - 1].replica]
        assert all(t.reason == "kv_load" for t in moved), [
            [(t.replica, t.reason) for t in c.turns] for c in convs]
        assert len(moved) <= len(later) // 2

        kids = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc, 20) == 0
        assert not any(os.path.exists(f"/proc/{k}") and _alive(k) for k in kids)
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(url + "/health")
        assert not any(p.exists() for p in meeting)  # the supervisor removed it


async def test_sigterm_lets_in_flight_streams_finish_on_every_worker(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    fake = await stack.enter_async_context(
        FakeReplica("r0", Behaviour(chunks=10, chunk_delay_s=0.1)))
    port = free_port()
    config = {"replicas": [{"url": fake.url, "id": "r0"}], "policy": "round_robin",
              "health": {"interval_s": 0.2}, "timeouts": {"shutdown_grace_s": 10}}
    url = f"http://127.0.0.1:{port}"
    http = await stack.enter_async_context(aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True)))
    with serve_workers(config, tmp_path, port) as proc:
        await ready(http, url, proc, [])

        async def stream() -> bytes:
            async with http.post(url + "/v1/chat/completions", json=chat(stream=True)) as r:
                assert r.status == 200
                return await r.read()

        streams = [asyncio.create_task(stream()) for _ in range(6)]
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        bodies = await asyncio.gather(*streams)
        assert all(b.endswith(b"data: [DONE]\n\n") and b.count(b"data: ") == 12
                   for b in bodies)
        assert await wait_exit(proc, 15) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def test_a_worker_that_cannot_start_stops_the_supervisor(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    import socket

    fake = await stack.enter_async_context(FakeReplica("r0"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    stack.callback(taken.close)
    admin_port = taken.getsockname()[1]  # worker 0's admin port is someone else's
    config = {"replicas": [{"url": fake.url, "id": "r0"}], "policy": "round_robin",
              "admin": {"enabled": True, "port": admin_port}}
    with serve_workers(config, tmp_path, free_port()) as proc:
        assert await wait_exit(proc, 90) == 1
        assert proc.stdout is not None
        assert b"exited 3 times" in proc.stdout.read()


async def test_workers_stop_when_the_supervisor_is_killed(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    fake = await stack.enter_async_context(FakeReplica("r0"))
    port = free_port()
    config = {"replicas": [{"url": fake.url, "id": "r0"}], "policy": "round_robin"}
    url = f"http://127.0.0.1:{port}"
    http = await stack.enter_async_context(aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=10)))
    before = _meeting_places()
    with serve_workers(config, tmp_path, port) as proc:
        await ready(http, url, proc, [])
        workers = children(proc.pid)
        assert len(workers) == 2
        proc.kill()  # SIGKILL: the supervisor cannot pass anything on
        proc.wait()
        deadline = time.monotonic() + 60
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "a worker outlived its supervisor"
            await asyncio.sleep(0.1)
    # the last worker out removed the directory the supervisor made for them
    assert not _meeting_places() - before


async def test_a_restarted_worker_hears_and_is_heard_by_the_others(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    """A worker killed and restarted by the supervisor binds its socket again where the
    dead one's file was left, and both workers hear each other's news again (the list of
    requests in flight goes out every second whatever the policy)."""
    fake = await stack.enter_async_context(FakeReplica("r0"))
    port = free_port()
    admin_port = free_ports(2, consecutive=True)[0]
    config = {"replicas": [{"url": fake.url, "id": "r0"}], "policy": "round_robin",
              "admin": {"enabled": True, "port": admin_port}}
    url = f"http://127.0.0.1:{port}"
    admins = [f"http://127.0.0.1:{admin_port + i}" for i in range(2)]
    http = await stack.enter_async_context(aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=10)))

    async def heard(admin: str) -> float:
        m = await scrape(http, admin)
        return m[("router_outlook_peer_messages_total", (("outcome", "applied"),))]

    async def hears_more(admin: str) -> None:
        start = await heard(admin)
        deadline = time.monotonic() + 20
        while await heard(admin) <= start:
            assert time.monotonic() < deadline, f"{admin} hears nothing from the other"
            await asyncio.sleep(0.2)

    with serve_workers(config, tmp_path, port) as proc:
        await ready(http, url, proc, admins)
        await hears_more(admins[1])
        for i, admin in enumerate(admins):
            async with http.get(admin + "/admin/replicas") as resp:
                assert (await resp.json())["worker"] == i
        first = children(proc.pid)
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len([p for p in children(proc.pid) if p != victim]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no restart"
            await asyncio.sleep(0.2)
        await ready(http, url, proc, admins)
        for admin in admins:  # the restarted one and the survivor alike
            await hears_more(admin)
