"""Local rendering equals vLLM 0.32's own rendering code, run in vLLM's environment.

The e2e suite compares against a running engine for a few conversations; this test goes
wide instead: many request shapes (tools, tool calls with string arguments, documents,
parts, developer messages, reasoning_effort, continue_final_message, kwargs, server
default kwargs, truncation, completions) are rendered by vLLM's ``HfRenderer`` exactly
as its OpenAI server drives it (``ChatCompletionRequest`` validation,
``build_chat_params().with_defaults(...)``, ``render_chat``; ``CompletionRequest`` and
``render_cmpl``), in a subprocess of ``.venv-vllm``'s interpreter with vLLM's own
transformers, and the ids are compared with ``RendererRegistry``'s.

Marked ``e2e``: it needs the vLLM CPU build (installed by ``.ci/install-vllm.sh``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from prompt.registry import ModelSpec, RendererRegistry

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SERVER_KWARGS = {"enable_thinking": False}

VLLM_SIDE = r"""
import json, sys
from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.renderers.hf import HfRenderer
from vllm.renderers.params import merge_kwargs
from vllm.tokenizers import get_tokenizer

job = json.load(sys.stdin)
out = {}
for model_dir, cases in job["models"].items():
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=4096, dtype="float32")
    renderer = HfRenderer(VllmConfig(model_config=mc), get_tokenizer(model_dir))
    res = out[model_dir] = {}
    for name, case in cases.items():
        try:
            if case["kind"] == "chat":
                req = ChatCompletionRequest.model_validate(case["body"])
                tools = None if req.tools is None else [t.model_dump() for t in req.tools]
                defaults = merge_kwargs(job["server_kwargs"], dict(tools=tools, tokenize=False))
                params = req.build_chat_params(None, "auto").with_defaults(defaults)
                _, (eng,) = renderer.render_chat([req.messages], params, req.build_tok_params(mc))
                res[name] = {"ids": [list(eng["prompt_token_ids"])]}
            else:
                req = CompletionRequest.model_validate(case["body"])
                p = req.prompt
                items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p
                prompts = [
                    {"prompt": i} if isinstance(i, str) else {"prompt_token_ids": i}
                    for i in items
                ]
                engs = renderer.render_cmpl(prompts, req.build_tok_params(mc))
                res[name] = {"ids": [list(e["prompt_token_ids"]) for e in engs]}
        except Exception as exc:  # the test compares error-ness too
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "oops"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "and"}, "tomorrow?", {"type": "text", "text": ""}],
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _chat(**body: Any) -> dict[str, Any]:
    return {"kind": "chat", "body": {"model": "m", **body}}


CASES: dict[str, dict[str, Any]] = {
    "tools_and_calls": _chat(messages=MESSAGES, tools=TOOLS),
    "documents": _chat(
        messages=[{"role": "user", "content": "sum up"}],
        documents=[{"title": "A", "text": "alpha"}, {"text": "untitled"}],
    ),
    "developer": _chat(
        messages=[
            {"role": "system", "content": "S"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "D"},
        ]
    ),
    "reasoning_none": _chat(messages=MESSAGES[:2], reasoning_effort="none"),
    "reasoning_high": _chat(messages=MESSAGES[:2], reasoning_effort="high"),
    "kwargs_override": _chat(
        messages=MESSAGES[:2], chat_template_kwargs={"enable_thinking": True, "unused": 1}
    ),
    "continue_final": _chat(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "Once "}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    "no_generation_prompt": _chat(messages=MESSAGES[:2], add_generation_prompt=False),
    "add_special_tokens": _chat(messages=MESSAGES[:2], add_special_tokens=True),
    "truncated": _chat(messages=MESSAGES, truncate_prompt_tokens=20),
    "special_text": _chat(messages=[{"role": "user", "content": "<|eot_id|><|im_end|> x"}]),
    "salted": _chat(messages=MESSAGES[:2], cache_salt="tenant-1"),
    "empty_assistant": _chat(
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
        + [{"role": "user", "content": "b"}]
    ),
    "cmpl_string": {"kind": "cmpl", "body": {"model": "m", "prompt": "Hello there world"}},
    "cmpl_batch": {
        "kind": "cmpl",
        "body": {"model": "m", "prompt": ["one", "two three"], "add_special_tokens": False},
    },
    "cmpl_ids": {"kind": "cmpl", "body": {"model": "m", "prompt": [[5, 6, 7], [8]]}},
    "cmpl_truncated": {
        "kind": "cmpl",
        "body": {"model": "m", "prompt": "a b c d e f g h", "truncate_prompt_tokens": 3},
    },
}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / ".ci" / "install-vllm.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return REPO / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from replica.vllm.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("vllm-render")
    return {t: build_tiny_model(root / t, template=t) for t in ("llama3", "chatml")}


def test_registry_renders_like_vllm(vllm_python: Path, model_dirs: dict[str, Path]) -> None:
    job = {
        "server_kwargs": SERVER_KWARGS,
        "models": {str(d): CASES for d in model_dirs.values()},
    }
    proc = subprocess.run(
        [str(vllm_python), "-c", VLLM_SIDE],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for template, d in model_dirs.items():
        registry = RendererRegistry(
            [
                ModelSpec(
                    name="m",
                    block_size=16,
                    tokenizer=d,
                    default_chat_template_kwargs=SERVER_KWARGS,
                )
            ]
        )
        for name, case in CASES.items():
            expected = theirs[str(d)][name]
            assert "error" not in expected, (template, name, expected)
            if case["kind"] == "chat":
                ours = [registry.render_chat(case["body"]).token_ids]
            else:
                ours = [p.token_ids for p in registry.render_completion(case["body"])]
            assert ours == expected["ids"], (template, name)
