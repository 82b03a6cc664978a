"""``replica.vllm``: tooling for real vLLM replicas: the launcher with the flags kvroute
needs (``replica.vllm.launcher``), its CLI mapping (``replica.vllm.cli``), and a tiny random
model and tokenizer for tests (``replica.vllm.tiny_model``, ``replica.vllm.tiny_tokenizer``,
not re-exported here: they load tokenizers and numpy, and ``kvroute --help`` imports this
package)."""

from __future__ import annotations

from replica.vllm.launcher import VllmReplicaSpec, build_command, launch

__all__ = ["VllmReplicaSpec", "build_command", "launch"]
