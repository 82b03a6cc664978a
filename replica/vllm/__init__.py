"""``replica.vllm``: tooling for real vLLM replicas: the launcher with the flags kvroute
needs, its CLI mapping, and a tiny random model and tokenizer for tests."""

from __future__ import annotations

from replica.vllm.launcher import VllmReplicaSpec, build_command, launch
from replica.vllm.tiny_model import build_tiny_model
from replica.vllm.tiny_tokenizer import build_tokenizer

__all__ = ["VllmReplicaSpec", "build_command", "build_tiny_model", "build_tokenizer", "launch"]
