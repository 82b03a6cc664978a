"""``prompt``: a request body in, token ids and block keys out, exactly as vLLM renders it.

Chat templates, tokenising and chained block keys (``RendererRegistry`` -> ``Prompt``,
``cache_salt`` on block 0, LoRA on every block), a replica's ``/tokenize`` as the fallback
(``RemoteRenderer``) and a sampled parity check (``ParityChecker``).  It knows nothing of
the KV index: block keys and ids come from ``kvkeys``.
"""

from __future__ import annotations

from prompt.errors import (
    InvalidCacheSalt,
    InvalidPrompt,
    ModelNotServed,
    RemoteRenderFailed,
    RenderError,
    RenderUnsupported,
)
from prompt.keyer import Prompt, validate_cache_salt
from prompt.parity import ParityChecker
from prompt.registry import ModelSpec, RendererRegistry
from prompt.remote_render import RemoteRenderer

__all__ = [
    "InvalidCacheSalt",
    "InvalidPrompt",
    "ModelNotServed",
    "ModelSpec",
    "ParityChecker",
    "Prompt",
    "RemoteRenderFailed",
    "RemoteRenderer",
    "RenderError",
    "RenderUnsupported",
    "RendererRegistry",
    "validate_cache_salt",
]
