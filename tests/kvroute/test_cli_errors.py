"""What a user sees when something is wrong: one line that names the problem and the
fix, a non-zero exit, and a traceback only with ``--log-level debug``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.cli import main
from replica.vllm.tiny_tokenizer import build_tokenizer

REPLICA = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)


def _one_clear_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def _kvroute(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    return subprocess.run([sys.executable, "-m", "kvroute", *argv], env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


# ---- serve ----------------------------------------------------------------------------


def test_serve_with_a_missing_tokenizer_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"replicas: [{REPLICA}]\nscoring:\n  models:\n"
                   f"    - {{name: m, tokenizer: {tmp_path / 'nowhere'}}}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    _one_clear_line(capsys.readouterr().err, "kvroute serve:", "scoring.models.0.tokenizer",
                    str(tmp_path / "nowhere"), "tokenizer.json")


def test_serve_on_a_busy_port_says_so(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replica", REPLICA, "--port", str(busy_port)]) == 1
    _one_clear_line(capsys.readouterr().err, f"cannot listen on 127.0.0.1:{busy_port}",
                    "--port")


def test_a_bare_replica_url_is_accepted(tmp_path: Path) -> None:
    from router.config import RouterSettings

    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"replicas:\n  - {REPLICA}\n  - url: http://127.0.0.1:10\n")
    s = RouterSettings.load(config_file=cfg, env={})
    assert [r.url for r in s.replicas] == [REPLICA, "http://127.0.0.1:10"]
    s = RouterSettings.load(env={"KVROUTE_REPLICAS": json.dumps([REPLICA])})
    assert s.replicas[0].url == REPLICA


def test_a_replica_that_is_neither_url_nor_mapping_is_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("replicas:\n  - 8001\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    _one_clear_line(capsys.readouterr().err, "replicas.0",
                    "each replica is a URL or a mapping with at least 'url:'")


def test_a_non_json_list_in_the_environment_shows_the_json_form(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVROUTE_REPLICAS", REPLICA)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    _one_clear_line(err, "KVROUTE_REPLICAS is not valid JSON", "values in the environment "
                    "are JSON", """KVROUTE_REPLICAS='["http://127.0.0.1:8001\"""")


# ---- indexer --------------------------------------------------------------------------


def test_indexer_without_redis_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["indexer", "--replica", REPLICA]) == 2
    _one_clear_line(capsys.readouterr().err, "kvroute indexer: needs a shared Redis index",
                    "--redis URL", "no router can read")


# ---- sim ------------------------------------------------------------------------------


def test_sim_with_a_bad_tokenizer_names_the_flag(tmp_path: Path) -> None:
    done = _kvroute("sim", "--model", "m", "--tokenizer", str(tmp_path / "nowhere"),
                    "--port", "0")
    assert done.returncode == 2
    _one_clear_line(done.stderr, "kvroute sim: --tokenizer", "tiny-model")
    debug = _kvroute("sim", "--model", "m", "--tokenizer", str(tmp_path / "nowhere"),
                     "--port", "0", "--log-level", "debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_sim_on_a_busy_port_says_so(tokenizer_dir: Path, busy_port: int) -> None:
    done = _kvroute("sim", "--model", "m", "--tokenizer", str(tokenizer_dir),
                    "--port", str(busy_port))
    assert done.returncode == 1
    _one_clear_line(done.stderr, f"kvroute sim: cannot listen on 127.0.0.1:{busy_port}",
                    "--port")


# ---- check-prompts --------------------------------------------------------------------


def _messages(n: int, system: str = "You are terse.") -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}]
    for i in range(1, n + 1):
        msgs.append({"role": "user", "content": f"question {i} about caching"})
        if i < n:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return msgs


def test_check_prompts_missing_file(tokenizer_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.jsonl"
    assert main(["check-prompts", str(missing), "--tokenizer", str(tokenizer_dir)]) == 2
    _one_clear_line(capsys.readouterr().err, f"cannot read {missing}")


def test_check_prompts_broken_jsonl_names_the_line(tokenizer_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_messages(1)) + "\n\n" + '[{"role": "user", "content": \n')
    assert main(["check-prompts", str(path), "--tokenizer", str(tokenizer_dir)]) == 2
    _one_clear_line(capsys.readouterr().err, f"{path}:3: not JSON")


def test_check_prompts_missing_tokenizer(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_messages(1)) + "\n")
    assert main(["check-prompts", str(path), "--tokenizer", str(tmp_path / "tok")]) == 2
    _one_clear_line(capsys.readouterr().err, f"--tokenizer {tmp_path / 'tok'}")


def test_check_prompts_exit_status_gates_ci(tokenizer_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps(_messages(n)) for n in (1, 2, 3)) + "\n")
    assert main(["check-prompts", str(clean), "--tokenizer", str(tokenizer_dir)]) == 0
    assert "0 of 3 turns under the threshold" in capsys.readouterr().out
    broken = tmp_path / "broken.jsonl"
    rows = [_messages(1), _messages(2, system="Today is day 2. You are terse.")]
    broken.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["check-prompts", str(broken), "--tokenizer", str(tokenizer_dir),
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["flagged"] == 1


# ---- demo -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policies", "kv,foo"], "unknown policy foo"),
        (["--policies", ","], "unknown policy (none given)"),
        (["--sessions", "0"], "--sessions must be at least 1"),
        (["--turns", "0"], "--turns must be at least 1"),
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--time-scale", "0"], "--time-scale must be above 0"),
    ],
)
def test_demo_rejects_bad_arguments_at_once(argv: list[str], needle: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *argv]) == 2
    _one_clear_line(capsys.readouterr().err, "kvroute demo:", needle)
    assert not out.exists()  # nothing was started or written
