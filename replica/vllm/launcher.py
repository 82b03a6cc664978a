"""Launch a real vLLM replica with every flag kvroute relies on.

A replica kvroute can route to must run with:

* ``--enable-prefix-caching`` (on by default in V1; passed explicitly so a changed
  default or a config file cannot silently turn the cache, and with it every
  ``BlockStored`` event, off);
* ``--enable-prompt-tokens-details`` so that ``usage.prompt_tokens_details.cached_tokens``
  is reported (the ground truth kvroute scores its predictions against);
* ``--kv-events-config`` with ``enable_kv_cache_events``, ``publisher: zmq``, the PUB
  ``endpoint``, the ROUTER ``replay_endpoint`` and a ``topic``;
* ``--block-size`` (a multiple of 32: vLLM's CPU attention rejects anything else, and one
  size across the fleet keeps the router's key geometry simple) and
  ``--served-model-name``.

vLLM *binds* its PUB socket when the endpoint contains ``*`` (or ``::``, or is ``ipc://``
/ ``inproc://``) and *connects* otherwise, so ``--kv-events-port P`` becomes
``tcp://*:P`` and the router's SUB connects to ``tcp://<host>:P``.  The replay socket is
always bound.  ``replica_entry`` turns a spec into the router's replica entry (``id``,
``url``, ``kv_events_endpoint``, ``replay_endpoint``) with the wildcard replaced by the
host the router should dial.

On a machine without a GPU, ``cpu=True`` adds what the CPU build needs:
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), ``--enforce-eager`` (no inductor
compilation: a tiny model starts in well under a minute on 2 cores instead of several)
and ``--dtype float32`` unless ``dtype`` says otherwise.  Left to choose, vLLM 0.32's CPU
build runs a float32 checkpoint in bfloat16 wherever the CPU advertises bfloat16, and
its AMX attention kernel then dies with an illegal instruction on hosts that advertise
AMX without enabling it for the process (seen on a 2-core VM: the engine core exits on
the first forward pass).
vLLM is started as ``<python> -m vllm.entrypoints.openai.api_server`` because the
``vllm`` console script of the CPU wheel fails to start here.

This module builds command lines and environments (pure), and starts or ``exec``s the
process; waiting for health and tearing down belong to the caller.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
DEFAULT_BLOCK_SIZE = 32
"""Tokens per KV block: the smallest size vLLM's CPU attention accepts (multiple of 32),
and a fine size on GPU too."""
DEFAULT_CPU_KVCACHE_GIB = 1
"""KV cache for the CPU build when no block count is forced: 1 GiB is ample for the tiny
model and keeps a replica near 3 GB of RAM."""


@dataclass(frozen=True, slots=True)
class VllmReplicaSpec:
    """Everything that determines one vLLM replica's command line and environment."""

    model: str
    """A local model directory or a model id (offline: must be in the HF cache)."""
    served_model_name: str
    """The name clients put in ``model``; the router's model key."""
    port: int
    """HTTP port of the OpenAI server."""
    host: str = "127.0.0.1"
    """HTTP bind address."""
    replica_id: str | None = None
    """Id in the router config; defaults to ``<host>:<port>``."""
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_events_endpoint: str = "tcp://*:5557"
    """vLLM's PUB endpoint (bound when it contains ``*``, or is ``ipc://``)."""
    replay_endpoint: str | None = "tcp://*:5558"
    """vLLM's ROUTER endpoint for replay (always bound); ``None`` disables replay."""
    topic: str = ""
    """First frame of every event message; ``""`` means ``kv@<replica_id>@<served name>``."""
    num_gpu_blocks: int | None = None
    """``--num-gpu-blocks-override``: the pool's size in blocks, *including* vLLM's
    null block (block 0), so ``num_gpu_blocks - 1`` blocks hold KV."""
    max_model_len: int | None = None
    cpu: bool = False
    """Add the CPU build's environment and ``--enforce-eager``."""
    cpu_kvcache_gib: int = DEFAULT_CPU_KVCACHE_GIB
    dtype: str | None = None
    """``--dtype``; ``None`` means ``float32`` with ``cpu`` (module docstring) and vLLM's
    own choice otherwise."""
    cpu_threads: int | None = None
    """CPU build on a small machine: run the model on this many OpenMP threads without
    pinning them to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``), so several replicas can
    share the cores, and run the model worker inside the engine-core process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process fewer to spawn and import, which
    is most of the start-up time).  ``None`` keeps vLLM's defaults (automatic core
    binding, a separate worker process)."""
    dev_mode: bool = False
    """``VLLM_SERVER_DEV_MODE=1``: enables ``POST /reset_prefix_cache`` (tests only)."""
    python: str = "python3"
    """The interpreter of the environment vLLM is installed in."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Passed to vLLM verbatim, after kvroute's flags."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.cpu and self.block_size % 32:
            raise ValueError(
                f"vLLM's CPU attention needs a block size that is a multiple of 32, "
                f"got {self.block_size}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")

    @property
    def id(self) -> str:
        """The replica's id in the router config."""
        return self.replica_id or f"{self.host}:{self.port}"

    @property
    def resolved_topic(self) -> str:
        """The topic vLLM will put on every event message."""
        return self.topic or f"kv@{self.id}@{self.served_model_name}"


def kv_events_config(spec: VllmReplicaSpec) -> dict[str, object]:
    """The ``--kv-events-config`` JSON object for ``spec``."""
    cfg: dict[str, object] = {
        "enable_kv_cache_events": True,
        # Explicit, because vLLM <= 0.11 defaulted to the null publisher.
        "publisher": "zmq",
        "endpoint": spec.kv_events_endpoint,
        "topic": spec.resolved_topic,
    }
    if spec.replay_endpoint is not None:
        cfg["replay_endpoint"] = spec.replay_endpoint
    return cfg


def build_command(spec: VllmReplicaSpec) -> list[str]:
    """The full argv that starts ``spec``'s replica."""
    cmd = [
        spec.python,
        "-m",
        VLLM_ENTRYPOINT,
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--block-size",
        str(spec.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events_config(spec), separators=(",", ":")),
    ]
    if spec.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    dtype = spec.dtype if spec.dtype is not None else ("float32" if spec.cpu else None)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if spec.cpu:
        cmd.append("--enforce-eager")
    cmd += list(spec.extra_args)
    return cmd


def build_env(spec: VllmReplicaSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The environment for ``spec``'s process: ``base`` plus what vLLM needs."""
    env = dict(base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if Path(spec.model).is_dir():
        # A local model needs no hub; never let a test or a laptop reach for it.
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    if spec.cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
        if spec.cpu_threads is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def dial_endpoint(endpoint: str, host: str) -> str:
    """The address a client dials for a socket vLLM binds at ``endpoint``.

    ``tcp://*:P`` and ``tcp://0.0.0.0:P`` become ``tcp://<host>:P``; anything else is
    already dialable and is returned unchanged.
    """
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


def replica_entry(spec: VllmReplicaSpec, advertise_host: str | None = None) -> dict[str, str]:
    """The router config entry for ``spec`` (``ReplicaSettings``' fields)."""
    host = advertise_host or ("127.0.0.1" if spec.host in ("0.0.0.0", "::") else spec.host)
    entry = {
        "id": spec.id,
        "url": f"http://{host}:{spec.port}",
        "kv_events_endpoint": dial_endpoint(spec.kv_events_endpoint, host),
    }
    if spec.replay_endpoint is not None:
        entry["replay_endpoint"] = dial_endpoint(spec.replay_endpoint, host)
    return entry


def replica_entry_yaml(spec: VllmReplicaSpec, advertise_host: str | None = None) -> str:
    """``replica_entry`` as one YAML list item, ready to paste under ``replicas:``."""
    dumped: str = yaml.safe_dump([replica_entry(spec, advertise_host)], sort_keys=False)
    return dumped


def launch(
    spec: VllmReplicaSpec,
    *,
    log_path: Path | None = None,
    base_env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start the replica in its own session (so its engine processes can be killed as one
    group); stdout and stderr go to ``log_path`` (appended) or are inherited."""
    env = build_env(spec, os.environ if base_env is None else base_env)
    cmd = build_command(spec)
    if log_path is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def exec_replica(spec: VllmReplicaSpec, base_env: Mapping[str, str] | None = None) -> None:
    """Replace this process with the replica (for the CLI); does not return."""
    env = build_env(spec, os.environ if base_env is None else base_env)
    cmd = build_command(spec)
    os.execvpe(cmd[0], cmd, env)


def shell_quote(cmd: Sequence[str]) -> str:
    """``cmd`` as one line a shell would run the same way."""
    import shlex

    return shlex.join(cmd)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CPU_KVCACHE_GIB",
    "VLLM_ENTRYPOINT",
    "VllmReplicaSpec",
    "build_command",
    "build_env",
    "dial_endpoint",
    "exec_replica",
    "kv_events_config",
    "launch",
    "replica_entry",
    "replica_entry_yaml",
    "shell_quote",
]
