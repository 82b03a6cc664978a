"""``prompt.__all__`` is the public surface, every name resolves to what it names, and
importing ``prompt`` loads none of the KV index (events, stores: ZMQ, Redis)."""

from __future__ import annotations

import subprocess
import sys

import prompt


def test_exported_members() -> None:
    assert prompt.__all__ == sorted(prompt.__all__)
    assert set(prompt.__all__) == {
        "InvalidCacheSalt", "InvalidPrompt", "ModelNotServed", "ModelSpec", "ParityChecker",
        "Prompt", "RemoteRenderFailed", "RemoteRenderer", "RenderError", "RenderUnsupported",
        "RendererRegistry", "validate_cache_salt",
    }
    for name in prompt.__all__:
        assert getattr(getattr(prompt, name), "__name__", name) == name


def test_prompt_does_not_load_the_index() -> None:
    heavy = "('index', 'zmq', 'redis')"
    code = f"import prompt, sys; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
