"""Request bodies to token ids, exactly as vLLM 0.32's OpenAI server computes them.

``ModelRenderer`` holds one model's tokenizer files and the server's rendering options
(:class:`RenderOptions`, mirroring ``vllm serve`` flags) and turns a request body into
:class:`Tokenized` (segments and token ids, see ``prompt.segments``).  It never calls
transformers: templates run in ``prompt.template_env`` and text is encoded by
``tokenizers`` through a ``SegmentEncoder``; tests prove equality with transformers.

Chat (``/v1/chat/completions``), in vLLM's order:

1. tools: each ``{"type": "function", "function": {...}}`` is re-serialised as vLLM's
   pydantic models dump it (``description`` and ``parameters`` present, ``null`` when
   absent; ``strict``/``defer_loading`` only when set); dropped when ``tool_choice`` is
   ``"none"`` and the server excludes tools then;
2. the template: the request's ``chat_template`` only when trusted (else 400), else the
   server's ``--chat-template``, else the tokenizer's (``tool_use`` variant with tools);
3. messages become the conversation (``prompt.chat_messages``) in the content format
   (``auto`` detects it from the template); developer messages become system messages
   when the template does not mention ``developer``;
4. template kwargs, lowest priority first: the server's default kwargs; ``tools``; the
   request's ``chat_template_kwargs``; the request's ``add_generation_prompt`` (default
   true), ``continue_final_message``, ``documents``, ``reasoning_effort`` (and
   ``enable_thinking = reasoning_effort != "none"`` unless the request set it).  A merge
   ignores values ``None`` and ``"auto"``.  Only kwargs the template reads, or that
   ``apply_chat_template`` names, are kept; the named special tokens are added beneath;
5. render (``continue_final_message`` cuts the text after the final message, as
   transformers does with its marker); a template error is a 400 (``TemplateRejected``);
6. tokenise with ``add_special_tokens`` (default false for chat, true for completions),
   then ``truncate_prompt_tokens`` (the tokenizer's truncation, on the left as vLLM
   configures tokenizers of generative models, keeping the special tokens it adds; or
   a plain slice when the request gives ``truncation_side``).

The next turn of a conversation redoes only what is new (``prompt.turns``): messages
already built are taken from the remembered turn, the template's message loop renders
only new messages (``prompt.message_loop``; templates it cannot prove message-local
are rendered whole), the text is cut only past what it shares with the previous text
(``SegmentEncoder.split``), its new pieces are encoded word by word where that is exact
(``prompt.words``) and ``Tokenized.key_resume`` lets the keyer start where the previous
prompt's shared segments left it.  Each shortcut is exact by construction,
and the result equals rendering and encoding the whole request (property tests).

Completions (``/v1/completions``): ``prompt`` is a string, a list of ids, a list of
strings or a list of id lists; each becomes one :class:`Tokenized`.  ``prompt_embeds``
and ``suffix`` raise ``RenderUnsupported``.

Not rendered locally (``RenderUnsupported``): media content, model-specific renderers
(Mistral, DeepSeek, Kimi, ...), harmony (gpt-oss), ``truncate_prompt_tokens=-1`` without
a known ``max_model_len``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2

from prompt.chat_messages import Message, build_conversation, convert_developer_role
from prompt.errors import InvalidPrompt, RenderUnsupported, TemplateRejected
from prompt.keyer import KeyResume, KeyTrail
from prompt.message_loop import LoopFallback, LoopRecord, message_loops
from prompt.segments import DEFAULT_MAX_CACHED_TOKENS, Segment, SegmentEncoder, TextSplit
from prompt.template_env import compile_template, detect_content_format, template_variables
from prompt.tokenizer import TokenizerFiles
from prompt.turns import DEFAULT_MAX_TURN_BYTES, Turn, TurnMemo

ContentFormatOption = Literal["auto", "string", "openai"]

_HF_CHAT_PARAMS = frozenset(
    {
        "self",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Parameters of transformers 5.x ``apply_chat_template`` (vLLM always accepts them)."""
_NOT_TEMPLATE_VARS = _HF_CHAT_PARAMS - {"documents"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_UNSET = (None, "auto")


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """The replica's rendering flags for one model (``vllm serve`` equivalents)."""

    chat_template: str | None = None
    """``--chat-template``: a template name of the tokenizer, or a template literal."""
    content_format: ContentFormatOption = "auto"
    """``--chat-template-content-format``."""
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """``--default-chat-template-kwargs``."""
    trust_request_chat_template: bool = False
    """``--trust-request-chat-template``."""
    exclude_tools_when_tool_choice_none: bool = False
    """``--exclude-tools-when-tool-choice-none``."""
    max_model_len: int | None = None
    """Only needed for ``truncate_prompt_tokens=-1``."""
    truncation_side: Literal["left", "right"] = "left"
    """The tokenizer's truncation side in the engine: vLLM's ``get_tokenizer`` forces
    ``"left"`` for generative models, whatever ``tokenizer_config.json`` says."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    """Token ids of one prompt; ``segments`` is ``None`` when they were truncated (the
    pieces no longer add up to the ids, so keys are computed from the ids)."""

    token_ids: list[int]
    segments: list[Segment] | None
    key_resume: KeyResume | None = None
    """For ``PromptKeyer.keys``: the previous turn's key trail and the segments this
    prompt shares with it (``None`` when there is no turn to record)."""


@dataclass(frozen=True, slots=True)
class ChatText:
    """A rendered chat prompt before tokenisation."""

    text: str
    add_special_tokens: bool
    truncate_prompt_tokens: int | None
    truncation_side: Literal["left", "right"] | None
    turn: Turn | None = None
    """This request as the conversation's next turn will reuse it (``prompt.turns``)."""
    base: Turn | None = None
    """The remembered turn this one extends."""


def merge_kwargs(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: overrides win unless they are ``None`` or ``"auto"``."""
    merged = dict(defaults)
    for key, value in overrides.items():
        if not _is_unset(value):
            merged[key] = value
    return merged


def _is_unset(value: object) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def dump_tools(tools: object) -> list[dict[str, Any]] | None:
    """Tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` hands them to templates."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidPrompt("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidPrompt("each tool must be a function tool", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidPrompt("each tool needs function.name", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidPrompt("function.parameters must be an object", param="tools")
        defer = tool.get("defer_loading")
        fn_defer = fn.get("defer_loading")
        if fn_defer is None and defer is not None:
            fn_defer = defer
        dumped_fn: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": copy.deepcopy(params),
        }
        if fn.get("strict") is not None:
            dumped_fn["strict"] = fn["strict"]
        if fn_defer is not None:
            dumped_fn["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


class ModelRenderer:
    """Renders and tokenises requests for one tokenizer, as the engine does."""

    def __init__(
        self,
        files: TokenizerFiles,
        options: RenderOptions | None = None,
        *,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
    ) -> None:
        self.files = files
        self.options = options or RenderOptions()
        self.encoder = SegmentEncoder(files.tokenizer, max_cached_tokens=max_cached_tokens)
        self.turns = TurnMemo(max_bytes=max_turn_bytes)

    # -- chat ---------------------------------------------------------------------------

    def chat_text(self, body: Mapping[str, Any]) -> ChatText:
        """Render a ``/v1/chat/completions`` (or ``/tokenize`` chat) body to text."""
        opts = self.options
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise InvalidPrompt(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        user_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(user_kwargs, Mapping):
            raise InvalidPrompt(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        request_template = body.get("chat_template")
        if not opts.trust_request_chat_template and (
            request_template is not None or user_kwargs.get("chat_template") is not None
        ):
            raise InvalidPrompt(
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template.",
                param="chat_template",
            )
        tools = dump_tools(body.get("tools"))
        if body.get("tool_choice") == "none" and opts.exclude_tools_when_tool_choice_none:
            tools = None
        documents = body.get("documents")
        reasoning_effort = body.get("reasoning_effort")
        extra: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final,
            "documents": documents,
            "reasoning_effort": reasoning_effort,
        }
        if reasoning_effort is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = reasoning_effort != "none"
        server = merge_kwargs(opts.default_chat_template_kwargs, {"tools": tools})
        kwargs = merge_kwargs(server, merge_kwargs(user_kwargs, extra))
        template_name = request_template if request_template is not None else opts.chat_template
        kwargs = merge_kwargs(kwargs, {"chat_template": template_name})
        text, turn, base = self._apply(body.get("messages"), kwargs)
        return ChatText(
            text=text,
            add_special_tokens=_flag(body, "add_special_tokens", False),
            truncate_prompt_tokens=_truncation(body),
            truncation_side=_side(body),
            turn=turn,
            base=base,
        )

    def apply_chat_template(self, messages: object, kwargs: Mapping[str, Any]) -> str:
        """vLLM's ``safe_apply_chat_template(..., tokenize=False, **kwargs)``.

        ``kwargs`` holds ``tools``, ``chat_template`` and everything else vLLM would pass
        (``add_generation_prompt``, ``documents``, template variables ...).
        """
        return self._apply(messages, kwargs)[0]

    def _apply(
        self, messages: object, kwargs: Mapping[str, Any]
    ) -> tuple[str, Turn | None, Turn | None]:
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        requested = kwargs.pop("chat_template", None)
        kwargs.pop("tokenize", None)
        try:
            source = self.files.chat_template(requested, has_tools=tools is not None)
        except LookupError as exc:
            raise TemplateRejected(str(exc)) from exc
        fmt = self.options.content_format
        content_format = detect_content_format(source) if fmt == "auto" else fmt
        started = self.turns.begin(messages, content_format)
        turn, base = started if started is not None else (None, None)
        if turn is not None:
            conversation = list(turn.conversation)  # the turn's own list stays as built
        else:
            conversation = build_conversation(messages, content_format)
        developer = (
            turn.has_developer
            if turn is not None
            else any(m["role"] == "developer" for m in conversation)
        )
        if developer and not ('"developer"' in source or "'developer'" in source):
            conversation = convert_developer_role(conversation)
        accepted = template_variables(source) | _HF_CHAT_PARAMS
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        text, loops = self._render(
            source, conversation, tools, kwargs, base.loops if base is not None else ()
        )
        if turn is not None:
            turn.loops = loops
            turn.text = text
            self.turns.remember(turn, base)
        return text, turn, base

    def _render(
        self,
        source: str,
        conversation: list[Message],
        tools: object,
        kwargs: dict[str, Any],
        base_loops: Sequence[LoopRecord] = (),
    ) -> tuple[str, list[LoopRecord]]:
        if "self" in kwargs or "conversation" in kwargs:
            raise TemplateRejected("chat_template_kwargs may not set 'self' or 'conversation'")
        if not conversation:
            raise TemplateRejected(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        documents = kwargs.pop("documents", None)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
        continue_final: bool | str = kwargs.pop("continue_final_message", False)
        for name in _NOT_TEMPLATE_VARS:
            kwargs.pop(name, None)
        if continue_final and add_generation_prompt:
            raise TemplateRejected(
                "continue_final_message and add_generation_prompt are not compatible."
            )
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise TemplateRejected("Tools should be a list of JSON schemas.")
        if documents is not None:
            if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
                raise TemplateRejected(
                    "Documents should be a list of dicts with 'title' and 'text' keys!"
                )
        final_text: str | None = None
        if continue_final:
            field_name = continue_final if isinstance(continue_final, str) else "content"
            final_text = _tag_final_message(conversation, field_name, source)
        context: dict[str, Any] = {**self.files.special_tokens, **kwargs}
        context.update(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        loops: list[LoopRecord] = []
        try:
            try:
                text, loops = message_loops(source).render(context, base_loops)
            except LoopFallback:
                text = compile_template(source).render(**context)
        except jinja2.TemplateError as exc:
            raise TemplateRejected(str(exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateRejected(f"chat template failed: {exc}") from exc
        if final_text is not None:
            text = _cut_after_final(text, final_text)
        return text, loops

    def tokenize_chat(self, body: Mapping[str, Any]) -> Tokenized:
        """Render and tokenise a chat body."""
        return self.tokenize_text(self.chat_text(body))

    def tokenize_text(self, chat: ChatText) -> Tokenized:
        """Tokenise a rendered chat prompt (resuming its base turn's split)."""
        turn = chat.turn
        if turn is None or chat.add_special_tokens:
            return self._tokenize(
                chat.text,
                chat.add_special_tokens,
                chat.truncate_prompt_tokens,
                chat.truncation_side,
            )
        base = chat.base
        previous: TextSplit | None = None
        trail: KeyTrail | None = None
        if base is not None:
            # The base turn was replaced (``TurnMemo.remember``): its split and key
            # trail are given up to this turn, which may take their lists over.
            previous, base.split = base.split, None
            trail = base.keys.trail if base.keys is not None else None
            base.keys = None
        split = self.encoder.split(chat.text, previous, spend=True)
        turn.split = split
        self.turns.recount(turn)
        ids = split.ids  # shared with the turn: read-only, as ``Prompt.token_ids`` is
        if chat.truncate_prompt_tokens is None:
            turn.keys = KeyResume(trail, split.shared)
            return Tokenized(ids, split.segments, turn.keys)
        cut = self._truncate(ids, 0, 0, chat.truncate_prompt_tokens, chat.truncation_side)
        return Tokenized(ids, split.segments) if cut is ids else Tokenized(cut, None)

    # -- completions --------------------------------------------------------------------

    def tokenize_completion(self, body: Mapping[str, Any]) -> list[Tokenized]:
        """Tokenise every prompt of a ``/v1/completions`` body, in order."""
        if body.get("prompt_embeds") is not None:
            raise RenderUnsupported("prompt_embeds are processed by the engine")
        if body.get("suffix") is not None:
            raise RenderUnsupported("suffix (fill-in-the-middle) is rendered by the engine")
        prompt = body.get("prompt")
        add_special = _flag(body, "add_special_tokens", True)
        limit, side = _truncation(body), _side(body)
        out: list[Tokenized] = []
        for item in _completion_items(prompt):
            if isinstance(item, str):
                out.append(self._tokenize(item, add_special, limit, side))
            else:
                ids = list(item)
                cut = self._truncate(ids, 0, 0, limit, side or self.options.truncation_side)
                out.append(Tokenized(cut, None))
        return out

    # -- tokenisation -------------------------------------------------------------------

    def _tokenize(
        self,
        text: str,
        add_special_tokens: bool,
        limit: int | None,
        side: Literal["left", "right"] | None,
    ) -> Tokenized:
        segments = self.encoder.segments(text, add_special_tokens=add_special_tokens)
        ids: list[int] = []
        for _, piece in segments:
            ids.extend(piece)
        if limit is None:
            return Tokenized(ids, segments)
        head = tail = 0
        if add_special_tokens and side is None:
            plain = self.encoder.encode(text)
            head = _index_of(ids, plain)
            tail = len(ids) - head - len(plain)
        cut = self._truncate(ids, head, tail, limit, side)
        return Tokenized(ids, segments) if cut is ids else Tokenized(cut, None)

    def _truncate(
        self,
        ids: list[int],
        head: int,
        tail: int,
        limit: int | None,
        side: Literal["left", "right"] | None,
    ) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``.

        With ``side`` unset the tokenizer truncates (on its own side), keeping the
        ``head``/``tail`` special tokens it added; with ``side`` set the whole list is
        sliced.  Returns ``ids`` itself when nothing is cut.
        """
        if limit is None:
            return ids
        if limit < 0:
            if self.options.max_model_len is None:
                raise RenderUnsupported("truncate_prompt_tokens=-1 needs max_model_len")
            limit = self.options.max_model_len - 1
        if limit == 0:
            return []
        if side is None:
            side = self.options.truncation_side
            room = max(limit - head - tail, 0)
            content = ids[head : len(ids) - tail]
            if len(content) > room:
                content = content[len(content) - room :] if side == "left" else content[:room]
                ids = [*ids[:head], *content, *ids[len(ids) - tail :]]
        if len(ids) <= limit:
            return ids
        return ids[len(ids) - limit :] if side == "left" else ids[:limit]


def _tag_final_message(conversation: list[Message], field_name: str, source: str) -> str:
    # The marker goes on a copy: the built message may be shared with remembered turns.
    conversation[-1] = copy.deepcopy(conversation[-1])
    final = conversation[-1].get(field_name)
    if final is None:
        raise TemplateRejected(
            "continue_final_message is set but the final message has no "
            f'"{field_name}" to continue!'
        )
    if field_name not in source:
        raise TemplateRejected(
            f'continue_final_message is set to "{field_name}" but this is not an accepted '
            "field in the chat_template"
        )
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return str(text)
        raise TemplateRejected(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    conversation[-1][field_name] = final + _CONTINUE_TAG
    return str(final)


def _cut_after_final(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateRejected(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template!"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidPrompt(f"'{name}' must be a boolean", param=name)
    return value


def _truncation(body: Mapping[str, Any]) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidPrompt(
            "truncate_prompt_tokens must be an integer >= -1", param="truncate_prompt_tokens"
        )
    return value


def _side(body: Mapping[str, Any]) -> Literal["left", "right"] | None:
    value = body.get("truncation_side")
    if value is None:
        return None
    if value not in ("left", "right"):
        raise InvalidPrompt(
            "`truncation_side` must be either 'left' or 'right'.", param="truncation_side"
        )
    return "left" if value == "left" else "right"


def _completion_items(prompt: object) -> list[str | Sequence[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token(p) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return list(prompt)
    if prompt is None or prompt == []:
        raise InvalidPrompt("Either prompt or prompt_embeds must be provided.", param="prompt")
    raise InvalidPrompt(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists",
        param="prompt",
    )


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _index_of(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    raise AssertionError("plain encoding not found inside the encoding with special tokens")


__all__ = [
    "ChatText",
    "ContentFormatOption",
    "ModelRenderer",
    "RenderOptions",
    "Tokenized",
    "dump_tools",
    "merge_kwargs",
]
