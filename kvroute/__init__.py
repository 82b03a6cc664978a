"""kvroute: a KV-cache-aware router for fleets of vLLM replicas.

This package is only the command-line composition root; the architecture lives in the
top-level packages ``index``, ``router``, ``replica`` and ``bench``.
"""

__version__ = "0.1.0"
