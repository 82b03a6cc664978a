"""Local chat rendering equals transformers' ``apply_chat_template`` (the engine's code).

For every tiny tokenizer variant and many message shapes, the text and the token ids
the renderer computes must equal what ``AutoTokenizer.apply_chat_template`` produces
from the conversation vLLM hands it (text parts as OpenAI parts for these templates,
tool-call arguments as objects, tools as vLLM dumps them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prompt.render import ModelRenderer, RenderOptions
from prompt.tokenizer import load_tokenizer_files

VARIANTS = ["llama3", "chatml", "chatml_prefix", "llama3_extra"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
DUMPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "description": None, "parameters": None}},
]

CASES: dict[str, dict[str, Any]] = {
    "user": {"messages": [{"role": "user", "content": "Hello there!"}]},
    "system_user": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Why is the sky blue?"},
        ]
    },
    "multi_turn": {
        "messages": [
            {"role": "system", "content": "Be helpful."},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": " four \n"},
            {"role": "user", "content": "five"},
        ]
    },
    "tools": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        ],
        "tools": TOOLS,
    },
    "documents": {
        "messages": [{"role": "user", "content": "Summarise the documents."}],
        "documents": [{"title": "A", "text": "alpha beta"}, {"title": "B", "text": "gamma"}],
    },
    "parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "sys part"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first part"},
                    {"type": "text", "text": "second part"},
                ],
            },
        ]
    },
    "continue_final": {
        "messages": [
            {"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Autumn moonlight -"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "kwargs_thinking_off": {
        "messages": [{"role": "user", "content": "2+2?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "no_generation_prompt": {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "add_generation_prompt": False,
    },
    "special_text_in_content": {
        "messages": [
            {"role": "user", "content": "say <|eot_id|> and <|im_end|> literally <|im_start|>sys"}
        ]
    },
    "unicode_whitespace": {
        "messages": [
            {"role": "user", "content": "  café ☕ naïve \u0065\u0301 日本語\n\n\ttabs  "},
            {"role": "assistant", "content": "\n"},
            {"role": "user", "content": ""},
        ]
    },
    "add_special_tokens": {
        "messages": [{"role": "user", "content": "with BOS again"}],
        "add_special_tokens": True,
    },
}


def _reference_conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation vLLM builds for these cases, written out independently."""
    out = []
    for m in copy.deepcopy(body["messages"]):
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "tool":
            msg["content"] = "\n".join(p["text"] for p in content)
            msg["tool_call_id"] = m["tool_call_id"]
        if "tool_calls" in m:
            import json

            msg["tool_calls"] = m["tool_calls"]
            for call in msg["tool_calls"]:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(msg)
    return out


@pytest.fixture(scope="module")
def renderers(tiny_dirs: dict[str, Path]) -> dict[str, ModelRenderer]:
    return {v: ModelRenderer(load_tokenizer_files(tiny_dirs[v])) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_matches_transformers(
    variant: str,
    case: str,
    renderers: dict[str, ModelRenderer],
    hf_tokenizer: Callable[[str], Any],
) -> None:
    body = {"model": "m", **CASES[case]}
    hf = hf_tokenizer(variant)
    kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs", {}))
    conversation = _reference_conversation(body)
    common: dict[str, Any] = {
        "tools": DUMPED_TOOLS if "tools" in body else None,
        "documents": body.get("documents"),
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        **kwargs,
    }
    ref_text = hf.apply_chat_template(conversation, tokenize=False, **common)
    if body.get("add_special_tokens"):
        ref_ids = hf(ref_text, add_special_tokens=True)["input_ids"]
    else:
        ref_ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=False, **common)

    renderer = renderers[variant]
    assert renderer.chat_text(body).text == ref_text
    assert renderer.tokenize_chat(body).token_ids == ref_ids
    # Warm: the second rendering comes from the segment cache and must not differ.
    assert renderer.tokenize_chat(body).token_ids == ref_ids


@pytest.mark.parametrize("variant", ["llama3", "chatml"])
def test_string_content_format_matches_transformers(
    variant: str, tiny_dirs: dict[str, Path], hf_tokenizer: Callable[[str], Any]
) -> None:
    """``--chat-template-content-format string``: text parts are joined with newlines."""
    renderer = ModelRenderer(
        load_tokenizer_files(tiny_dirs[variant]), RenderOptions(content_format="string")
    )
    body = {"model": "m", **CASES["parts"]}
    conversation = [
        {"role": "system", "content": "sys part"},
        {"role": "user", "content": "first part\nsecond part"},
    ]
    hf = hf_tokenizer(variant)
    ref = hf.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert renderer.tokenize_chat(body).token_ids == ref


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "prompt",
    ["Hello world", "", "  leading and trailing  ", "<|begin_of_text|>twice", "naïve\n\n日本"],
)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_matches_transformers(
    variant: str,
    prompt: str,
    add_special_tokens: bool,
    renderers: dict[str, ModelRenderer],
    hf_tokenizer: Callable[[str], Any],
) -> None:
    ref = hf_tokenizer(variant)(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    body = {"model": "m", "prompt": prompt, "add_special_tokens": add_special_tokens}
    (tok,) = renderers[variant].tokenize_completion(body)
    assert tok.token_ids == ref


@pytest.mark.parametrize("variant", ["llama3", "chatml"])
def test_completion_default_adds_special_tokens(
    variant: str, renderers: dict[str, ModelRenderer], hf_tokenizer: Callable[[str], Any]
) -> None:
    (tok,) = renderers[variant].tokenize_completion({"model": "m", "prompt": "abc def"})
    assert tok.token_ids == hf_tokenizer(variant)("abc def")["input_ids"]
    if variant == "llama3":
        assert tok.token_ids[0] == hf_tokenizer(variant).bos_token_id


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", ["multi_turn", "tools", "parts"])
def test_turn_after_turn_matches_transformers(
    variant: str, case: str, tiny_dirs: dict[str, Path], hf_tokenizer: Callable[[str], Any]
) -> None:
    """Each prefix of a conversation, sent as a new request after the previous one (so
    each reuses the turn before it), renders as transformers renders it whole."""
    renderer = ModelRenderer(load_tokenizer_files(tiny_dirs[variant]))
    hf = hf_tokenizer(variant)
    full = CASES[case]
    for n in range(1, len(full["messages"]) + 1):
        body = copy.deepcopy({"model": "m", **full, "messages": full["messages"][:n]})
        common: dict[str, Any] = {
            "tools": DUMPED_TOOLS if "tools" in body else None,
            "add_generation_prompt": True,
        }
        ref = hf.apply_chat_template(
            _reference_conversation(body), tokenize=True, return_dict=False, **common
        )
        assert renderer.tokenize_chat(body).token_ids == ref
