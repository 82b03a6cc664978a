"""Request bodies to token ids, exactly as vLLM 0.32's OpenAI server computes them.

``ModelRenderer`` holds one model's tokenizer files and the server's rendering options
(``prompt.chat_options.RenderOptions``, mirroring ``vllm serve`` flags) and turns a
request body into :class:`Tokenized` (segments, token ids and, when asked, block
keys).  It never calls transformers: templates run in ``prompt.template_env`` and text
is encoded by ``tokenizers`` through a ``SegmentEncoder``; tests prove equality with
transformers.

Chat (``/v1/chat/completions``), in vLLM's order (steps 1 and 4 read the body:
``prompt.chat_options``):

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

``ModelRenderer.render_chat`` chains the stages in one place: body -> messages ->
text -> ids -> keys.  Each stage is a function of its input and of the conversation's
previous prompt (``prompt.conversation.CachedPrompt``), and the new prompt is
remembered once every stage has run.  The next turn of a conversation so redoes only
what is new: messages already built are taken from the previous prompt, the
template's message loop renders only new messages (``prompt.message_loop``; templates
it cannot prove message-local are rendered whole), the text is cut only past what it
shares with the previous text (``SegmentEncoder.split``), its new pieces are encoded
word by word where that is exact (``prompt.words``), and the keys continue from the
previous prompt's shared pieces (``PromptKeyer.trail``).  Each shortcut is exact by
construction, and the result equals rendering and encoding the whole request
(property tests).

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
from dataclasses import dataclass
from typing import Any, Literal

import jinja2

from kvkeys.types import RequestKey
from prompt.chat_messages import Message, build_conversation, convert_developer_role
from prompt.chat_options import (
    RenderOptions,
    body_flag,
    body_truncation,
    body_truncation_side,
    parse_chat_request,
)
from prompt.conversation import (
    DEFAULT_MAX_TURN_BYTES,
    CachedPrompt,
    ConversationMemo,
)
from prompt.errors import InvalidPrompt, RenderUnsupported, TemplateRejected
from prompt.keyer import KeyContext, PromptKeyer
from prompt.message_loop import LoopFallback, LoopRecord, message_loops
from prompt.segments import DEFAULT_MAX_CACHED_TOKENS, Segment, SegmentEncoder
from prompt.template_env import (
    ContentFormat,
    compile_template,
    detect_content_format,
    template_variables,
)
from prompt.tokenizer import TokenizerFiles
from prompt.words import DEFAULT_MAX_WORDS

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


@dataclass(frozen=True, slots=True)
class Tokenized:
    """Token ids of one prompt; ``segments`` is ``None`` when they were truncated (the
    pieces no longer add up to the ids, so keys are computed from the ids).  Read-only:
    the lists may be the conversation's cached prompt's."""

    token_ids: Sequence[int]
    segments: list[Segment] | None
    block_keys: list[RequestKey] | None = None
    """The keys, when the renderer was given a ``Keying`` and computed them."""


@dataclass(frozen=True, slots=True)
class Keying:
    """How to key a chat prompt: the key chain's parameters and the memo of states."""

    keyer: PromptKeyer
    context: KeyContext


@dataclass(frozen=True, slots=True)
class ChatText:
    """A rendered chat prompt before tokenisation."""

    text: str
    add_special_tokens: bool
    truncate_prompt_tokens: int | None
    truncation_side: Literal["left", "right"] | None


@dataclass(frozen=True, slots=True)
class _Template:
    """The template a request renders with, and the kwargs it accepts."""

    source: str
    tools: object
    kwargs: dict[str, Any]
    content_format: ContentFormat


class ModelRenderer:
    """Renders and tokenises requests for one tokenizer, as the engine does."""

    def __init__(
        self,
        files: TokenizerFiles,
        options: RenderOptions | None = None,
        *,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
        max_cached_words: int = DEFAULT_MAX_WORDS,
    ) -> None:
        self.files = files
        self.options = options or RenderOptions()
        self.encoder = SegmentEncoder(files.tokenizer, max_cached_tokens=max_cached_tokens,
                                      max_cached_words=max_cached_words)
        self.conversations = ConversationMemo(max_bytes=max_turn_bytes)

    def warm(self) -> None:
        """Compile and analyse the tokenizer's chat templates now, not on the first
        request: a template's first use costs tens of milliseconds (parsing, the message
        loop analysis), which a router would otherwise spend on its event loop serving
        the first chat.  A template that does not parse is left for the request that
        uses it to report."""
        for source in self.files.chat_templates.values():
            detect_content_format(source)
            message_loops(source)
            try:
                template_variables(source)
                compile_template(source)
            except jinja2.TemplateError:
                continue

    # -- chat ---------------------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any], keying: Keying | None = None) -> Tokenized:
        """Render, tokenise and (with ``keying``) key a chat body, reusing the
        conversation's previous prompt: body -> messages -> text -> ids -> keys."""
        request = parse_chat_request(body, self.options)
        template = self._template(request.kwargs)
        opened = self.conversations.open(request.messages, template.content_format)
        if opened is None:  # not plain data: rendered whole, nothing to remember
            conversation = build_conversation(request.messages, template.content_format)
            text, _ = self._text(template, conversation, _has_developer(conversation), ())
            return self._tokenize(text, request.add_special_tokens,
                                  request.truncate_prompt_tokens, request.truncation_side)
        previous = opened.previous
        built = opened.messages
        text, loops = self._text(template, built.conversation, built.has_developer,
                                 previous.loops if previous is not None else ())
        if request.add_special_tokens:  # the affixes break the split: encoded whole
            self.conversations.remember(CachedPrompt(built, loops), replacing=previous)
            return self._tokenize(text, True, request.truncate_prompt_tokens,
                                  request.truncation_side)
        split = self.encoder.split(text, previous.split if previous is not None else None)
        if request.truncate_prompt_tokens is not None:
            self.conversations.remember(CachedPrompt(built, loops, split), replacing=previous)
            ids = split.ids.tolist()
            cut = self._truncate(ids, 0, 0, request.truncate_prompt_tokens,
                                 request.truncation_side)
            return Tokenized(ids, split.segments) if cut is ids else Tokenized(cut, None)
        trail = None
        if keying is not None:
            trail = keying.keyer.trail(
                keying.context, split.segments, shared=split.shared,
                previous=previous.keys if previous is not None else None,
            )
        self.conversations.remember(CachedPrompt(built, loops, split, trail), replacing=previous)
        return Tokenized(split.ids, split.segments, trail.keys if trail is not None else None)

    def tokenize_chat(self, body: Mapping[str, Any]) -> Tokenized:
        """Render and tokenise a chat body (``render_chat`` without keys)."""
        return self.render_chat(body)

    def chat_text(self, body: Mapping[str, Any]) -> ChatText:
        """Render a ``/v1/chat/completions`` (or ``/tokenize`` chat) body to text (from
        the conversation's previous prompt where it applies; nothing is remembered)."""
        request = parse_chat_request(body, self.options)
        template = self._template(request.kwargs)
        opened = self.conversations.open(request.messages, template.content_format)
        if opened is None:
            conversation = build_conversation(request.messages, template.content_format)
            text, _ = self._text(template, conversation, _has_developer(conversation), ())
        else:
            previous = opened.previous
            text, _ = self._text(template, opened.messages.conversation,
                                 opened.messages.has_developer,
                                 previous.loops if previous is not None else ())
        return ChatText(text, request.add_special_tokens, request.truncate_prompt_tokens,
                        request.truncation_side)

    def apply_chat_template(self, messages: object, kwargs: Mapping[str, Any]) -> str:
        """vLLM's ``safe_apply_chat_template(..., tokenize=False, **kwargs)``.

        ``kwargs`` holds ``tools``, ``chat_template`` and everything else vLLM would pass
        (``add_generation_prompt``, ``documents``, template variables ...).
        """
        template = self._template(kwargs)
        conversation = build_conversation(messages, template.content_format)
        return self._text(template, conversation, _has_developer(conversation), ())[0]

    def _template(self, kwargs: Mapping[str, Any]) -> _Template:
        """The template source for ``kwargs`` (``tools``, ``chat_template``), its content
        format and the kwargs it accepts."""
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
        accepted = template_variables(source) | _HF_CHAT_PARAMS
        return _Template(source, tools, {k: v for k, v in kwargs.items() if k in accepted},
                         content_format)

    def _text(
        self,
        template: _Template,
        conversation: list[Message],
        has_developer: bool,
        previous_loops: Sequence[LoopRecord],
    ) -> tuple[str, list[LoopRecord]]:
        """The text stage: built messages to the rendered prompt (and its loops)."""
        source = template.source
        conversation = list(conversation)  # the built list stays as built
        if has_developer and not ('"developer"' in source or "'developer'" in source):
            conversation = convert_developer_role(conversation)
        return self._render(source, conversation, template.tools, dict(template.kwargs),
                            previous_loops)

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

    # -- completions --------------------------------------------------------------------

    def tokenize_completion(self, body: Mapping[str, Any]) -> list[Tokenized]:
        """Tokenise every prompt of a ``/v1/completions`` body, in order."""
        if body.get("prompt_embeds") is not None:
            raise RenderUnsupported("prompt_embeds are processed by the engine")
        if body.get("suffix") is not None:
            raise RenderUnsupported("suffix (fill-in-the-middle) is rendered by the engine")
        prompt = body.get("prompt")
        add_special = body_flag(body, "add_special_tokens", True)
        limit, side = body_truncation(body), body_truncation_side(body)
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


def _has_developer(conversation: list[Message]) -> bool:
    return any(m["role"] == "developer" for m in conversation)


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


__all__ = ["ChatText", "Keying", "ModelRenderer", "Tokenized"]
