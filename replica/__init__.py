"""``replica``: the replica side, in two subpackages that share nothing but this name.

* ``replica.sim``: the vLLM-faithful simulated replica (block pool, scheduler, engine,
  HTTP server, KV event publisher, fleet runner).
* ``replica.vllm``: real vLLM tooling (the launcher and its CLI mapping, the tiny test
  model and tokenizer).
"""

from __future__ import annotations

__all__: list[str] = []
