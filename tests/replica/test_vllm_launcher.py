"""The vLLM launcher's command line, environment and router entry."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from kvroute.cli import main
from replica.vllm.launcher import (
    VllmReplicaSpec,
    build_command,
    build_env,
    dial_endpoint,
    kv_events_config,
    replica_entry,
    replica_entry_yaml,
)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_has_every_flag_kvroute_relies_on() -> None:
    spec = VllmReplicaSpec(model="/m", served_model_name="llama", port=8001,
                           replica_id="r1", python="/venv/bin/python")
    cmd = build_command(spec)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(cmd, "--model") == "/m"
    assert _flag(cmd, "--served-model-name") == "llama"
    assert _flag(cmd, "--port") == "8001" and _flag(cmd, "--host") == "127.0.0.1"
    assert _flag(cmd, "--block-size") == "32"
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert json.loads(_flag(cmd, "--kv-events-config")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv@r1@llama",
    }
    for absent in ("--num-gpu-blocks-override", "--max-model-len", "--enforce-eager", "--dtype"):
        assert absent not in cmd


def test_optional_flags_and_extra_args_come_last() -> None:
    spec = VllmReplicaSpec(model="m", served_model_name="s", port=1, num_gpu_blocks=65,
                           max_model_len=2048, cpu=True, replay_endpoint=None, topic="t",
                           extra_args=("--max-num-seqs", "4"))
    cmd = build_command(spec)
    assert _flag(cmd, "--num-gpu-blocks-override") == "65"
    assert _flag(cmd, "--max-model-len") == "2048"
    assert "--enforce-eager" in cmd
    assert _flag(cmd, "--dtype") == "float32"  # the CPU build's default here
    assert cmd[-2:] == ["--max-num-seqs", "4"]
    gpu_bf16 = VllmReplicaSpec(model="m", served_model_name="s", port=1, dtype="bfloat16")
    assert _flag(build_command(gpu_bf16), "--dtype") == "bfloat16"
    cfg = json.loads(_flag(cmd, "--kv-events-config"))
    assert "replay_endpoint" not in cfg and cfg["topic"] == "t"
    assert kv_events_config(spec) == cfg


def test_env_for_cpu_dev_and_local_models(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    gpu = build_env(VllmReplicaSpec(model="org/model", served_model_name="s", port=1), base)
    assert gpu == {"PATH": "/bin", "OMP_NUM_THREADS": "8", "PYTHONUNBUFFERED": "1"}
    spec = VllmReplicaSpec(model=str(tmp_path), served_model_name="s", port=1, cpu=True,
                           cpu_kvcache_gib=2, cpu_threads=1, dev_mode=True)
    env = build_env(spec, base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert base == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}  # not mutated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu": True, "block_size": 16}, "multiple of 32"),
        ({"block_size": 0}, "positive"),
        ({"num_gpu_blocks": 1}, "null block"),
    ],
)
def test_invalid_specs_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VllmReplicaSpec(model="m", served_model_name="s", port=1, **kwargs)  # type: ignore[arg-type]


def test_gpu_accepts_block_size_16() -> None:
    spec = VllmReplicaSpec(model="m", served_model_name="s", port=1, block_size=16)
    assert _flag(build_command(spec), "--block-size") == "16"


def test_dial_endpoint_replaces_wildcards_only() -> None:
    assert dial_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert dial_endpoint("tcp://0.0.0.0:5557", "h") == "tcp://h:5557"
    assert dial_endpoint("tcp://10.1.1.1:5557", "h") == "tcp://10.1.1.1:5557"
    assert dial_endpoint("ipc:///tmp/x", "h") == "ipc:///tmp/x"


def test_replica_entry_for_the_router_config() -> None:
    spec = VllmReplicaSpec(model="m", served_model_name="s", port=8001, host="0.0.0.0",
                           kv_events_endpoint="tcp://*:6000", replay_endpoint="tcp://*:6001")
    assert replica_entry(spec, "gpu-a") == {
        "id": "0.0.0.0:8001",
        "url": "http://gpu-a:8001",
        "kv_events_endpoint": "tcp://gpu-a:6000",
        "replay_endpoint": "tcp://gpu-a:6001",
    }
    assert replica_entry(spec)["url"] == "http://127.0.0.1:8001"
    assert yaml.safe_load(replica_entry_yaml(spec, "gpu-a")) == [replica_entry(spec, "gpu-a")]


def test_cli_dry_run_prints_entry_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "replica", "vllm", "--model", "/models/x", "--served-model-name", "x", "--port", "9000",
        "--id", "a", "--kv-events-port", "7000", "--replay-port", "7001", "--cpu",
        "--num-gpu-blocks", "100", "--python", "/py", "--dtype", "bfloat16", "--dry-run", "--",
        "--seed", "3",
    ])
    assert code == 0
    out = capsys.readouterr().out
    entry = yaml.safe_load("\n".join(line for line in out.splitlines()
                                     if not line.startswith("#")))
    assert entry == [{"id": "a", "url": "http://127.0.0.1:9000",
                      "kv_events_endpoint": "tcp://127.0.0.1:7000",
                      "replay_endpoint": "tcp://127.0.0.1:7001"}]
    command = next(line for line in out.splitlines() if line.startswith("# /py "))
    argv = shlex.split(command[2:])
    assert argv[-2:] == ["--seed", "3"] and "--enforce-eager" in argv
    assert _flag(argv, "--num-gpu-blocks-override") == "100"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert json.loads(_flag(argv, "--kv-events-config"))["endpoint"] == "tcp://*:7000"


def test_cli_rejects_a_bad_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replica", "vllm", "--model", "m", "--served-model-name", "x", "--port", "1",
                 "--cpu", "--block-size", "16", "--dry-run"])
    assert code == 2
    assert "multiple of 32" in capsys.readouterr().err
