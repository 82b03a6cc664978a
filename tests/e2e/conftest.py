"""Fixtures of the end-to-end suite: real vLLM (CPU build) replicas on the tiny model.

One set of replicas serves the whole e2e run (startup dominates on 2 cores):

* ``vllm_python`` (session): makes sure vLLM is installed by running
  ``.ci/install-vllm.sh`` (idempotent: a fraction of a second when ``.venv-vllm`` is
  complete, a full install otherwise) and returns ``.venv-vllm/bin/python``.
* ``tiny_model_dir`` (session): the tiny random Llama with its Llama-3-style tokenizer
  (``replica.vllm.tiny_model.build_tiny_model``), built once into a temporary directory.
* ``vllm_fleet`` (session): ``E2E_REPLICAS`` (2) ``vllm_fleet.VllmReplica`` handles,
  started in parallel and healthy; served model name ``E2E_MODEL``; block size
  ``E2E_BLOCK_SIZE`` (32); ``--num-gpu-blocks-override E2E_NUM_GPU_BLOCKS`` (65: vLLM
  keeps block 0 as its null block, so 64 blocks = 2,048 tokens hold KV, small enough for
  the fidelity trace to evict); ``--max-model-len E2E_MAX_MODEL_LEN`` (2,048, the most
  that fits); KV events on a private ``ipc://`` PUB with topic ``kv@vllm-<i>@<model>`` and
  replay on a free loopback TCP port; dev mode (``POST /reset_prefix_cache``); one OpenMP
  thread each, unpinned.  Logs go to ``<tmp>/vllm-<i>.log`` (the handle's ``log_path``).
  The replicas are stopped (process groups killed) at the end of the session.
* ``vllm_replica``: the first replica of the fleet.

Tests share the replicas, so a test that depends on the cache's contents starts with
``replica.reset_prefix_cache()``; a test that kills a replica must ``restart()`` it before
it ends.  Every test in this folder is marked ``e2e`` (added here if a module forgot) and
gets a 900 s timeout unless it sets its own: the first test to use the fleet pays for
starting it.

This folder is on ``sys.path`` so test modules can ``import vllm_fleet``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from vllm_fleet import VllmReplica, replica_spec, start_replicas  # noqa: E402

REPO = _HERE.parents[1]
E2E_MODEL = "tiny-llama"
E2E_REPLICAS = 2
E2E_BLOCK_SIZE = 32
E2E_NUM_GPU_BLOCKS = 65
E2E_MAX_MODEL_LEN = (E2E_NUM_GPU_BLOCKS - 1) * E2E_BLOCK_SIZE
E2E_TIMEOUT_S = 900


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test in this folder ``e2e`` and give it the e2e timeout."""
    for item in items:
        if _HERE not in Path(str(item.path)).resolve().parents:
            continue
        if item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """``.venv-vllm``'s interpreter, after making sure vLLM is installed there."""
    script = REPO / ".ci" / "install-vllm.sh"
    proc = subprocess.run(
        ["bash", str(script)], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    python = REPO / ".venv-vllm" / "bin" / "python"
    assert python.exists(), python
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (Llama-3-style template), built once per session."""
    from replica.vllm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama3"), template="llama3")


@pytest.fixture(scope="session")
def vllm_fleet(
    vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmReplica]]:
    """Two real vLLM replicas on the tiny model, healthy, shared by the whole e2e run."""
    workdir = tmp_path_factory.mktemp("vllm")
    replicas = [
        VllmReplica(
            spec=replica_spec(
                index=i,
                model_dir=tiny_model_dir,
                python=str(vllm_python),
                workdir=workdir,
                served_model_name=E2E_MODEL,
                block_size=E2E_BLOCK_SIZE,
                num_gpu_blocks=E2E_NUM_GPU_BLOCKS,
                max_model_len=E2E_MAX_MODEL_LEN,
            ),
            log_path=workdir / f"vllm-{i}.log",
            model_dir=tiny_model_dir,
        )
        for i in range(E2E_REPLICAS)
    ]
    start_replicas(replicas)
    try:
        yield replicas
    finally:
        for r in replicas:
            r.stop(grace_s=10.0)


@pytest.fixture(scope="session")
def vllm_replica(vllm_fleet: list[VllmReplica]) -> VllmReplica:
    """The first replica of the fleet."""
    replica = vllm_fleet[0]
    if not replica.alive:
        replica.restart()
    return replica
