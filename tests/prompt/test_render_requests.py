"""vLLM 0.32's request-handling rules, one test per rule (see ``prompt.render`` and
``prompt.chat_messages`` for the rules and where vLLM implements them)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from prompt.chat_messages import build_conversation
from prompt.errors import InvalidPrompt, RenderUnsupported, TemplateRejected
from prompt.render import ModelRenderer, RenderOptions, dump_tools, merge_kwargs
from prompt.template_env import compile_template, detect_content_format
from prompt.tokenizer import load_tokenizer_files


@pytest.fixture(scope="module")
def llama(tiny_dirs: dict[str, Path]) -> ModelRenderer:
    return ModelRenderer(load_tokenizer_files(tiny_dirs["llama3"]))


@pytest.fixture(scope="module")
def chatml(tiny_dirs: dict[str, Path]) -> ModelRenderer:
    return ModelRenderer(load_tokenizer_files(tiny_dirs["chatml"]))


def _with(renderer: ModelRenderer, **options: Any) -> ModelRenderer:
    return ModelRenderer(renderer.files, RenderOptions(**options))


# -- messages -> conversation -----------------------------------------------------------


def test_string_format_joins_text_parts_and_drops_empty_ones() -> None:
    parts = [
        "bare",
        {"type": "text", "text": "b"},
        {"type": "input_text", "text": "c"},
        {"type": "text", "text": ""},
        {"type": "text"},
        {"type": "refusal", "refusal": "r"},
        {"type": "thinking", "thinking": "t"},
    ]
    (msg,) = build_conversation([{"role": "user", "content": parts}], "string")
    assert msg == {"role": "user", "content": "bare\nb\nc\nr\nt"}


def test_openai_format_wraps_every_text_part_and_keeps_unknown_keys() -> None:
    conv = build_conversation(
        [
            {"role": "user", "content": "plain"},
            {"role": "user", "content": [{"type": "input_text", "text": "x", "cache": 1}]},
            {"role": "assistant", "content": None},
        ],
        "openai",
    )
    assert conv[0]["content"] == [{"type": "text", "text": "plain"}]
    assert conv[1]["content"] == [{"type": "text", "text": "x", "cache": 1}]
    assert conv[2]["content"] == []


def test_none_content_is_empty_string_in_string_format() -> None:
    (msg,) = build_conversation([{"role": "assistant", "content": None}], "string")
    assert msg["content"] == ""


def test_only_known_message_keys_survive() -> None:
    (msg,) = build_conversation(
        [{"role": "user", "content": "x", "name": "bob", "task": "t", "weird": 1}], "string"
    )
    assert msg == {"role": "user", "content": "x", "name": "bob", "task": "t"}


def test_assistant_reasoning_is_copied_under_both_names() -> None:
    (msg,) = build_conversation(
        [{"role": "assistant", "content": "a", "reasoning": "because"}], "string"
    )
    assert msg["reasoning"] == msg["reasoning_content"] == "because"


def test_tool_message_parts_are_joined_even_in_openai_format() -> None:
    (msg,) = build_conversation(
        [
            {
                "role": "tool",
                "tool_call_id": "c",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        "openai",
    )
    assert msg == {"role": "tool", "content": "a\nb", "tool_call_id": "c"}


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"city": "Paris"}', {"city": "Paris"}),
        ("not json", {}),
        ("[1, 2]", {}),
        ("", {}),
        (None, {}),
        ({"already": "dict"}, {"already": "dict"}),
    ],
)
def test_tool_call_arguments_become_objects(arguments: object, parsed: object) -> None:
    call = {"type": "function", "id": "c1", "function": {"name": "f", "arguments": arguments}}
    (msg,) = build_conversation(
        [{"role": "assistant", "content": "", "tool_calls": [call]}], "string"
    )
    (out,) = msg["tool_calls"]
    assert out["function"]["arguments"] == parsed
    assert list(out) == ["id", "function", "type"]  # pydantic's order
    assert list(out["function"]) == ["arguments", "name"]


def test_empty_tool_calls_are_removed_and_non_function_calls_rejected() -> None:
    (msg,) = build_conversation([{"role": "assistant", "content": "x", "tool_calls": []}], "string")
    assert "tool_calls" not in msg
    bad = {"type": "custom", "id": "c", "custom": {"name": "f", "input": "x"}}
    with pytest.raises(InvalidPrompt):
        build_conversation([{"role": "assistant", "content": "", "tool_calls": [bad]}], "string")


def test_system_billing_header_line_is_stripped() -> None:
    (msg,) = build_conversation(
        [{"role": "system", "content": "x-anthropic-billing-header: cch=123\nreal system"}],
        "string",
    )
    assert msg["content"] == "real system"


@pytest.mark.parametrize(
    ("part", "error"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, RenderUnsupported),
        ({"image_url": {"url": "http://x/y.png"}}, RenderUnsupported),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, RenderUnsupported),
        ({"type": "hologram"}, InvalidPrompt),
        ({"text": "no type"}, InvalidPrompt),
        ({"type": 3}, InvalidPrompt),
    ],
)
def test_media_is_left_to_the_engine_and_bad_parts_rejected(
    part: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        build_conversation([{"role": "user", "content": [part]}], "openai")


def test_rendering_never_mutates_the_request(llama: ModelRenderer) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    before = copy.deepcopy(body)
    llama.tokenize_chat(body)
    assert body == before


# -- tools and kwargs -------------------------------------------------------------------


def test_tools_are_dumped_as_vllm_dumps_them() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "extra": 1}, "other": 2},
        {
            "type": "function",
            "defer_loading": True,
            "function": {"name": "b", "description": "d", "parameters": {}, "strict": False},
        },
    ]
    assert dump_tools(tools) == [
        {"type": "function", "function": {"name": "a", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {
                "name": "b",
                "description": "d",
                "parameters": {},
                "strict": False,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    with pytest.raises(InvalidPrompt):
        dump_tools([{"type": "function", "function": {"description": "no name"}}])


def test_merge_ignores_none_and_auto() -> None:
    assert merge_kwargs({"a": 1, "b": 2}, {"a": None, "b": "auto", "c": 3}) == {
        "a": 1,
        "b": 2,
        "c": 3,
    }


def test_request_flags_override_chat_template_kwargs(llama: ModelRenderer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    text = llama.chat_text(
        {"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}
    ).text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_server_default_kwargs_apply_and_request_kwargs_win(llama: ModelRenderer) -> None:
    server = _with(llama, default_chat_template_kwargs={"enable_thinking": False})
    msgs = [{"role": "user", "content": "hi"}]
    assert server.chat_text({"messages": msgs}).text.endswith("<think>\n\n</think>\n\n")
    overridden = server.chat_text(
        {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}}
    ).text
    assert not overridden.endswith("</think>\n\n")


def test_template_kwargs_may_override_special_tokens(llama: ModelRenderer) -> None:
    text = llama.chat_text(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"bos_token": "B"}}
    ).text
    assert text.startswith("B<|start_header_id|>")


@pytest.mark.parametrize(("effort", "thinking_off"), [("none", True), ("high", False)])
def test_reasoning_effort_sets_enable_thinking(
    chatml: ModelRenderer, effort: str, thinking_off: bool
) -> None:
    text = chatml.chat_text(
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": effort}
    ).text
    assert text.endswith("<think>\n\n</think>\n\n") is thinking_off


def test_tools_dropped_for_tool_choice_none_only_when_configured(chatml: ModelRenderer) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
    }
    assert "<tools>" in chatml.chat_text(body).text
    excluding = _with(chatml, exclude_tools_when_tool_choice_none=True)
    assert "<tools>" not in excluding.chat_text(body).text


def test_request_chat_template_needs_trust(chatml: ModelRenderer) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template": "T:{{ messages[0].content }}",
    }
    with pytest.raises(InvalidPrompt):
        chatml.chat_text(body)
    with pytest.raises(InvalidPrompt):
        chatml.chat_text(
            {"messages": body["messages"], "chat_template_kwargs": {"chat_template": "x"}}
        )
    trusted = _with(chatml, trust_request_chat_template=True)
    assert trusted.chat_text(body).text == "T:x"


def test_server_chat_template_overrides_the_tokenizers(chatml: ModelRenderer) -> None:
    server = _with(chatml, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert server.chat_text({"messages": [{"role": "user", "content": "x"}]}).text == "[x]"


def test_developer_messages_become_one_leading_system_message(chatml: ModelRenderer) -> None:
    text = chatml.chat_text(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "u"},
                {"role": "developer", "content": "D"},
            ]
        }
    ).text
    assert text.startswith("<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nu")


# -- template errors are client errors --------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": []},
        {
            "messages": [{"role": "assistant", "content": None}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"self": 1}},
    ],
)
def test_template_failures_are_rejections(llama: ModelRenderer, body: dict[str, Any]) -> None:
    with pytest.raises(TemplateRejected):
        llama.chat_text(body)


def test_both_generation_flags_are_a_bad_request(llama: ModelRenderer) -> None:
    with pytest.raises(InvalidPrompt):
        llama.chat_text(
            {
                "messages": [{"role": "user", "content": "x"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            }
        )


def test_continue_final_message_cuts_after_the_final_content(llama: ModelRenderer) -> None:
    text = llama.chat_text(
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "partial answer"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
    ).text
    assert text.endswith("<|end_header_id|>\n\npartial answer")


def test_environment_matches_transformers_helpers() -> None:
    tpl = compile_template(
        "{{ {'b': 1, 'a': '<é>'} | tojson }}|{{ [1] | tojson(indent=2) }}|{{ strftime_now('%Y') }}"
    )
    first, second, year = tpl.render().split("|")
    assert first == json.dumps({"b": 1, "a": "<é>"}, ensure_ascii=False)
    assert second == "[\n  1\n]"
    assert year.isdigit()
    loop = compile_template(
        "{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    assert loop.render() == "1"
    trimmed = compile_template("  {% if true %}\nx\n{% endif %}\n")
    assert trimmed.render() == "x\n"


def test_sandbox_refuses_mutation(chatml: ModelRenderer) -> None:
    server = _with(chatml, chat_template="{{ messages.append(1) }}")
    with pytest.raises(TemplateRejected):
        server.chat_text({"messages": [{"role": "user", "content": "x"}]})


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set ms = messages[1:] %}{% for m in ms %}"
            "{% for p in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro t(c) %}{% for p in c %}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ t(m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set content = m.content %}"
            "{% for p in content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for i, m in messages|enumerate %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}{{ m.content }", "string"),
    ],
)
def test_content_format_detection_follows_vllm(template: str, fmt: str) -> None:
    assert detect_content_format(template) == fmt


# -- tokenisation options ---------------------------------------------------------------


def test_chat_add_special_tokens_adds_a_second_bos(llama: ModelRenderer) -> None:
    msgs = [{"role": "user", "content": "x"}]
    plain = llama.tokenize_chat({"messages": msgs}).token_ids
    doubled = llama.tokenize_chat({"messages": msgs, "add_special_tokens": True}).token_ids
    assert doubled == [plain[0], *plain]


def test_truncation_is_left_and_keeps_the_bos_by_default(llama: ModelRenderer) -> None:
    """vLLM sets the tokenizer's truncation side to "left" for generative models; the
    tokenizer's own truncation keeps the BOS it adds.  An explicit side slices."""
    prompt = "one two three four five six seven eight nine ten"
    (full,) = llama.tokenize_completion({"prompt": prompt})
    (kept,) = llama.tokenize_completion({"prompt": prompt, "truncate_prompt_tokens": 4})
    assert kept.token_ids == [full.token_ids[0], *full.token_ids[-3:]]
    assert kept.segments is None
    (left,) = llama.tokenize_completion(
        {"prompt": prompt, "truncate_prompt_tokens": 4, "truncation_side": "left"}
    )
    assert left.token_ids == full.token_ids[-4:]
    (right,) = llama.tokenize_completion(
        {"prompt": prompt, "truncate_prompt_tokens": 4, "truncation_side": "right"}
    )
    assert right.token_ids == full.token_ids[:4]
    right_tok = _with(llama, truncation_side="right")
    (head,) = right_tok.tokenize_completion({"prompt": prompt, "truncate_prompt_tokens": 4})
    assert head.token_ids == full.token_ids[:4]
    (whole,) = llama.tokenize_completion({"prompt": prompt, "truncate_prompt_tokens": 500})
    assert whole.token_ids == full.token_ids and whole.segments is not None
    chat = {"messages": [{"role": "user", "content": prompt}], "truncate_prompt_tokens": 5}
    untruncated = llama.tokenize_chat({"messages": chat["messages"]}).token_ids
    assert llama.tokenize_chat(chat).token_ids == untruncated[-5:]


def test_truncation_to_model_length_needs_it(llama: ModelRenderer) -> None:
    with pytest.raises(RenderUnsupported):
        llama.tokenize_completion({"prompt": "abc", "truncate_prompt_tokens": -1})
    sized = _with(llama, max_model_len=3)
    (cut,) = sized.tokenize_completion({"prompt": "a b c d e f", "truncate_prompt_tokens": -1})
    assert len(cut.token_ids) == 2


def test_completion_prompt_shapes(llama: ModelRenderer) -> None:
    one = llama.tokenize_completion({"prompt": "a b"})
    batch = llama.tokenize_completion({"prompt": ["a b", "c"]})
    assert batch[0].token_ids == one[0].token_ids and len(batch) == 2
    assert [t.token_ids for t in llama.tokenize_completion({"prompt": [5, 6, 7]})] == [[5, 6, 7]]
    ids = llama.tokenize_completion({"prompt": [[1, 2], [3]]})
    assert [t.token_ids for t in ids] == [[1, 2], [3]]
    cut = llama.tokenize_completion({"prompt": [1, 2, 3], "truncate_prompt_tokens": 2})
    assert cut[0].token_ids == [2, 3]  # left, as vLLM truncates for generative models


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({}, InvalidPrompt),
        ({"prompt": []}, InvalidPrompt),
        ({"prompt": ["a", 1]}, InvalidPrompt),
        ({"prompt": [[1], []]}, InvalidPrompt),
        ({"prompt": [-1]}, InvalidPrompt),
        ({"prompt": "x", "add_special_tokens": "yes"}, InvalidPrompt),
        ({"prompt": "x", "truncate_prompt_tokens": -2}, InvalidPrompt),
        ({"prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "middle"}, InvalidPrompt),
        ({"prompt_embeds": "AAAA"}, RenderUnsupported),
        ({"prompt": "x", "suffix": "y"}, RenderUnsupported),
    ],
)
def test_bad_completion_bodies(
    llama: ModelRenderer, body: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        llama.tokenize_completion(body)
