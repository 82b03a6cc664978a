"""``kvroute serve``: help, start-up validation, and the real process (uvloop, httptools)
under SIGTERM: in-flight streams finish within the grace period, or are cut at its end."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest

from kvroute.cli import main
from router.app import create_app
from router.config import RouterSettings
from router.conn_guard import GuardedHttpToolsProtocol
from router.serving import _GC_YOUNG, _tune_gc, _uvicorn_config
from tests.ports import free_port
from tests.router.conftest import StartFakes
from tests.router.helpers import chat, measure_ttfb


def test_kvroute_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "serve" in capsys.readouterr().out


def test_serve_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--replica", "--config", "--policy", "--log-level",
                   "--max-body-bytes", "max_body_bytes", "--workers", "KVROUTE_"):
        assert option in out
    assert out.count("URL") >= 2


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--replica", "ftp://nope"], {}, "replicas.0.url"),
        (["--replica", "http://127.0.0.1:1", "--policy", "nope"], {}, "policy"),
        (["--replica", "http://127.0.0.1:1"], {"KVROUTE_TIMEOUTS__CONNECT_S": "x"},
         "timeouts.connect_s"),
        ([], {}, "replicas"),
        (["--replica", "http://127.0.0.1:1", "--max-body-bytes", "0"], {}, "max_body_bytes"),
    ],
)
def test_serve_rejects_bad_config(argv: list[str], env: dict[str, str], needle: str,
                                  capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "kvroute serve:" in err


def test_serve_rejects_bad_config_file(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("replicas:\n  - url: http://127.0.0.1:1\nhealth:\n  interval_s: 0\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "health.interval_s" in err and str(cfg) in err


@pytest.mark.parametrize("access_log", [False, True])
def test_serve_uvicorn_config(access_log: bool) -> None:
    """uvloop and httptools; X-Forwarded-* handling only when there is an access log."""
    settings = RouterSettings.load(cli={"replicas": [{"url": "http://127.0.0.1:1"}],
                                        "access_log": access_log})
    config = _uvicorn_config(create_app(settings), settings)
    assert (config.loop, config.lifespan) == ("uvloop", "on")
    assert isinstance(config.http, type) and issubclass(config.http, GuardedHttpToolsProtocol)
    assert config.http.limits == settings.connections
    assert config.proxy_headers is access_log and config.access_log is access_log
    assert not config.server_header and not config.date_header


def test_serve_gc_tuning() -> None:
    before = gc.get_threshold()
    try:
        _tune_gc()
        assert gc.get_threshold() == (_GC_YOUNG, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@contextmanager
def _serve_process(replica: str, port: int, grace_s: int) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update({"KVROUTE_TIMEOUTS__SHUTDOWN_GRACE_S": str(grace_s),
                "KVROUTE_HEALTH__INTERVAL_S": "0.2"})
    kvroute = os.path.join(os.path.dirname(sys.executable), "kvroute")
    proc = subprocess.Popen(
        [kvroute, "serve", "--host", "127.0.0.1", "--port", str(port), "--replica", replica,
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


@asynccontextmanager
async def _ready(client: aiohttp.ClientSession, url: str,
                 proc: subprocess.Popen[bytes]) -> AsyncIterator[None]:
    deadline = time.monotonic() + 60  # process start-up on a loaded machine
    while True:
        assert proc.poll() is None, "kvroute serve exited"
        try:
            async with client.get(url + "/ready") as resp:
                if resp.status == 200:
                    break
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "kvroute serve did not become ready"
        await asyncio.sleep(0.05)
    yield


async def _until_refused(url: str, timeout: float = 5.0) -> None:
    """Wait until new connections are refused (the listening socket is closed)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        while True:
            try:
                async with fresh.get(url) as r:
                    await r.read()
            except aiohttp.ClientConnectionError:
                return
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            await asyncio.sleep(0.05)


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> float:
    t0 = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - t0 < timeout, "kvroute serve did not exit"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_sigterm_lets_streams_finish(fakes: StartFakes,
                                           client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 10
    fake.behaviour.chunk_delay_s = 0.1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serve_process(fake.url, port, grace_s=10) as proc:
        async with _ready(client, url, proc):
            # time to first streamed byte through the real server (uvloop) vs direct
            body = orjson.dumps(chat(stream=True))
            fake.behaviour.chunks = 1
            direct, routed, gap = await measure_ttfb(client, fake.url, url, body)
            assert gap < 0.02, gap
            assert routed < direct + 0.03, (routed, direct)
            fake.behaviour.chunks = 10
            async with client.post(url + "/v1/chat/completions", data=body) as resp:
                first = await resp.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                await _until_refused(url + "/health")  # no longer accepting
                rest = await resp.read()
            data = first + rest
            assert data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 12
            # it exits once the stream is done, long before the 10 s grace
            took = await _wait_exit(proc, 8)
            assert took < 6
            assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal


async def test_sigterm_cancels_streams_after_grace(fakes: StartFakes,
                                                  client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.chunks = 100
    fake.behaviour.chunk_delay_s = 0.1
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serve_process(fake.url, port, grace_s=1) as proc:
        async with _ready(client, url, proc):
            async with client.post(url + "/v1/chat/completions", json=chat(stream=True)) as resp:
                await resp.content.readuntil(b"\n\n")
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
                cut_after = time.monotonic() - t0
            # cut at the 1 s grace, long before the stream's own 10 s end
            assert 0.9 < cut_after < 7
            await _wait_exit(proc, 5)
            assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    seen = fake.completions()[-1]
    deadline = time.monotonic() + 2
    while seen.ended is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert seen.cancelled



def test_serve_logs_its_address_and_replicas(caplog: pytest.LogCaptureFixture) -> None:
    from router.serving import _log_start

    settings = RouterSettings.load(cli={"replicas": ["http://127.0.0.1:8001",
                                                     "http://127.0.0.1:8002"]}, env={})
    with caplog.at_level("INFO", logger="kvroute.serve"):
        _log_start(settings, 43210)
    text = caplog.text
    assert "listening on http://127.0.0.1:43210 (policy kv, index memory)" in text
    assert "replica 127.0.0.1:8001: http://127.0.0.1:8001" in text
    assert "replica 127.0.0.1:8002: http://127.0.0.1:8002" in text
