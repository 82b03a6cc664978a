"""The append-only prompt checker: why does turn N+1 miss the cache turn N left behind?

Prefix caching only helps a conversation when each prompt is an append-only extension of
the previous one, token for token.  This module takes transcripts as the application
sends them (one message list per turn), renders each turn exactly as the engine would
(a ``ChatTokenizer``: the shared ``index`` renderer by default), and reports per turn:

* ``tokens``: the prompt's length;
* ``shared``: tokens in common with the previous prompt (longest common prefix);
* ``reusable_blocks``: full blocks the engine could serve from cache, with vLLM's rule
  that the last prompt token is always recomputed (``min(shared, tokens - 1) // B``);
* ``share``: ``shared / previous tokens``, the part of the previous prompt kept;
* for a turn whose share is under the threshold (default 0.9): the first differing token,
  the message it falls in, and a likely cause (``Cause``).

With the engine's generated token ids of the previous turn (from a log, or captured by the
router), the previous sequence is ``previous prompt + generated ids``, which is what the
engine cached; the checker then also sees the breaks that plain re-rendering cannot:
reasoning stripped from the echoed reply, and re-tokenisation drift (the reply's text
re-encodes to other ids than the ones generated).  A turn is then also flagged when less
than the threshold of the reply survives (``reply_share``).

Attribution compares the message lists of the two turns first (tools, then the first
differing message), then looks at the reply against the generated ids.  It is a
heuristic: it names the most likely cause, and the first differing token is always
reported so a human can confirm.

Input (JSONL): each line is a message list, or an object with ``messages`` and optionally
``session``, ``tools``, ``chat_template_kwargs``, ``generated_token_ids`` (of the reply
to this turn).  Lines of one session are consecutive turns; without ``session`` all lines
form one session.  Generated ids may also come from a separate JSONL log of objects
``{"session", "turn", "token_ids"}`` (turn is 1-based).

What it does not do: talk to an engine, or fix the prompts.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

Message = Mapping[str, Any]

DEFAULT_THRESHOLD = 0.9

_THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_SUMMARY_HINT = re.compile(r"summar|recap|earlier conversation|so far", re.IGNORECASE)


class Cause(enum.StrEnum):
    """Why a turn is not an append-only extension of the previous one."""

    DYNAMIC_PREFIX = "dynamic_prefix"
    """Content at the top (system prompt, first message) changed: a timestamp, a random id."""
    TOOLS_CHANGED = "tools_changed"
    """The tool list changed or was reordered (rendered near the top)."""
    REASONING_STRIPPED = "reasoning_stripped"
    """The previous reply came back without the reasoning the engine generated."""
    TRUNCATION = "truncation"
    """Older messages were dropped (a sliding window)."""
    SUMMARY_REPLACEMENT = "summary_replacement"
    """Older messages were replaced by a new one (a summary)."""
    RETOKENIZATION_DRIFT = "retokenization_drift"
    """The reply's text re-encodes to other token ids than the engine generated."""
    HISTORY_EDITED = "history_edited"
    """An earlier message was edited in place."""
    RENDER_CHANGED = "render_changed"
    """Same messages, other tokens: template arguments or a template that is not
    append-only (it renders something dynamic, or differently once a message follows)."""
    UNKNOWN = "unknown"


class ChatTokenizer(Protocol):
    """Chat rendering + tokenisation exactly as the engine does it."""

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens kept)."""
        ...


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of a transcript as the application sent it."""

    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    generated_token_ids: tuple[int, ...] | None = None
    """The engine's generated ids of the reply to this turn, when known."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a turn's tokens first differ from what was cached before it."""

    position: int
    previous_token: int | None
    current_token: int | None
    previous_text: str
    current_text: str
    message_index: int | None
    """The message of the current turn the differing token falls in (None: template)."""
    message_role: str | None
    cause: Cause
    detail: str


@dataclass(frozen=True, slots=True)
class TurnReport:
    """The checker's figures for one turn (turn 1 has nothing to compare with)."""

    turn: int
    tokens: int
    shared: int
    reusable_blocks: int
    share: float | None
    reply_share: float | None = None
    flagged: bool = False
    divergence: Divergence | None = None


@dataclass(frozen=True, slots=True)
class SessionReport:
    """All turns of one session."""

    session: str
    turns: list[TurnReport] = field(default_factory=list)

    @property
    def flagged(self) -> list[TurnReport]:
        """Turns under the threshold."""
        return [t for t in self.turns if t.flagged]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    # compare in chunks first: most prompts share long prefixes
    step = 256
    while i + step <= n and list(a[i : i + step]) == list(b[i : i + step]):
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable_blocks(shared: int, tokens: int, block_size: int) -> int:
    """Full blocks servable from cache: vLLM recomputes the last prompt token."""
    if tokens <= 0:
        return 0
    return max(min(shared, tokens - 1), 0) // block_size


def _strip_reasoning(msg: Message) -> dict[str, Any]:
    out = {k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning")}
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = _THINK_RE.sub("", content)
    return out


def _has_reasoning(msg: Message) -> bool:
    content = msg.get("content")
    return bool(msg.get("reasoning_content") or msg.get("reasoning")) or (
        isinstance(content, str) and "<think>" in content
    )


def _content_text(msg: Message | None) -> str:
    if msg is None:
        return ""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


class Checker:
    """Checks the turns of sessions against one another with one ``ChatTokenizer``."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        block_size: int = 16,
        threshold: float = DEFAULT_THRESHOLD,
    ) -> None:
        if block_size <= 0 or not 0.0 <= threshold <= 1.0:
            raise ValueError("block_size must be > 0 and threshold within [0, 1]")
        self._tok = tokenizer
        self.block_size = block_size
        self.threshold = threshold

    def _render(self, turn: Turn, messages: Sequence[Message] | None = None,
                generation_prompt: bool = True) -> list[int]:
        return self._tok.render(
            list(turn.messages if messages is None else messages),
            tools=list(turn.tools) if turn.tools is not None else None,
            add_generation_prompt=generation_prompt,
            chat_template_kwargs=turn.chat_template_kwargs,
        )

    def _message_at(self, turn: Turn, position: int) -> int | None:
        """Index of the message of ``turn`` that token ``position`` falls in."""
        for k in range(1, len(turn.messages) + 1):
            if len(self._render(turn, turn.messages[:k], generation_prompt=False)) > position:
                return k - 1
        return None

    def check_session(self, turns: Sequence[Turn], session: str = "") -> SessionReport:
        """Reports for every turn of one session, in order."""
        report = SessionReport(session)
        prev_turn: Turn | None = None
        prev_tokens: list[int] = []
        for n, turn in enumerate(turns, 1):
            tokens = self._render(turn)
            if prev_turn is None:
                report.turns.append(TurnReport(n, len(tokens), 0, 0, None))
            else:
                report.turns.append(self._compare(n, prev_turn, prev_tokens, turn, tokens))
            prev_turn, prev_tokens = turn, tokens
        return report

    def _compare(
        self, n: int, prev: Turn, prev_tokens: list[int], cur: Turn, tokens: list[int]
    ) -> TurnReport:
        shared = common_prefix(prev_tokens, tokens)
        share = shared / len(prev_tokens) if prev_tokens else 1.0
        gen = list(prev.generated_token_ids) if prev.generated_token_ids is not None else None
        cached = prev_tokens + gen if gen is not None else prev_tokens
        cached_shared = common_prefix(cached, tokens) if gen is not None else shared
        reply_share: float | None = None
        if gen:
            kept = max(cached_shared - len(prev_tokens), 0)
            # the last generated token is never fed back, so it is never cached
            reply_share = min(kept / max(len(gen) - 1, 1), 1.0)
        flagged = share < self.threshold or (
            reply_share is not None and reply_share < self.threshold
        )
        divergence = None
        if flagged:
            pos = cached_shared if share >= self.threshold else shared
            divergence = self._explain(prev, prev_tokens, gen, cur, tokens, pos)
        return TurnReport(
            turn=n,
            tokens=len(tokens),
            shared=cached_shared,
            reusable_blocks=reusable_blocks(cached_shared, len(tokens), self.block_size),
            share=round(share, 4),
            reply_share=None if reply_share is None else round(reply_share, 4),
            flagged=flagged,
            divergence=divergence,
        )

    def _explain(
        self,
        prev: Turn,
        prev_tokens: list[int],
        gen: list[int] | None,
        cur: Turn,
        tokens: list[int],
        pos: int,
    ) -> Divergence:
        cached = prev_tokens + (gen or [])
        msg_index = self._message_at(cur, pos) if pos < len(tokens) else None
        cause, detail = self._cause(prev, prev_tokens, gen, cur, pos, msg_index)
        role = None
        if msg_index is not None:
            r = cur.messages[msg_index].get("role")
            role = r if isinstance(r, str) else None
        lo = max(pos - 8, 0)
        return Divergence(
            position=pos,
            previous_token=cached[pos] if pos < len(cached) else None,
            current_token=tokens[pos] if pos < len(tokens) else None,
            previous_text=self._tok.decode(cached[lo : pos + 8]),
            current_text=self._tok.decode(tokens[lo : pos + 8]),
            message_index=msg_index,
            message_role=role,
            cause=cause,
            detail=detail,
        )

    def _cause(
        self,
        prev: Turn,
        prev_tokens: list[int],
        gen: list[int] | None,
        cur: Turn,
        pos: int,
        msg_index: int | None,
    ) -> tuple[Cause, str]:
        p, c = list(prev.messages), list(cur.messages)
        if (prev.tools or None) != (cur.tools or None):
            return Cause.TOOLS_CHANGED, "the tools list differs from the previous turn"
        k = next((i for i in range(min(len(p), len(c))) if dict(p[i]) != dict(c[i])), None)
        if k is None and len(c) < len(p):
            return Cause.TRUNCATION, f"the history lost its last {len(p) - len(c)} message(s)"
        if k is None:
            if pos >= len(prev_tokens) and gen is not None:
                return self._reply_cause(gen, c[len(p)] if len(p) < len(c) else None)
            if prev.chat_template_kwargs != cur.chat_template_kwargs:
                return Cause.RENDER_CHANGED, "chat_template_kwargs changed"
            if msg_index == 0:
                return Cause.DYNAMIC_PREFIX, "the template renders changing content at the top"
            return Cause.RENDER_CHANGED, "same messages, different tokens: the template is " \
                "not append-only"
        pk, ck = p[k], c[k]
        if _has_reasoning(pk) and _strip_reasoning(pk) == {
            key: v for key, v in ck.items() if key not in ("reasoning_content", "reasoning")
        }:
            return Cause.REASONING_STRIPPED, f"message {k}: the assistant's reasoning was removed"
        if k == 0 or (k == 1 and p[0].get("role") != "system"):
            if len(c) >= len(p) and all(dict(a) == dict(b) for a, b in zip(p[1:], c[1:],
                                                                            strict=False)):
                return Cause.DYNAMIC_PREFIX, f"message {k} ({pk.get('role')}) changed at the " \
                    "top of the prompt"
        # messages dropped: c continues with a later message of p
        later = [j for j in range(k + 1, len(p)) if dict(p[j]) == dict(ck)]
        if later:
            return Cause.TRUNCATION, f"messages {k}..{later[0] - 1} were dropped"
        # several messages of p replaced by one new message, then p continues
        if k + 1 < len(c):
            nxt = dict(c[k + 1])
            if any(dict(p[j]) == nxt for j in range(k + 2, len(p))) or (
                len(c) - len(p) < 1 and _SUMMARY_HINT.search(_content_text(ck))
            ):
                return Cause.SUMMARY_REPLACEMENT, f"messages from {k} on were replaced by a " \
                    "new message"
        if _SUMMARY_HINT.search(_content_text(ck)) and len(c) <= len(p):
            return Cause.SUMMARY_REPLACEMENT, f"message {k} looks like a summary of the history"
        return Cause.HISTORY_EDITED, f"message {k} ({pk.get('role')}) was edited"

    def _reply_cause(self, gen: list[int], reply: Message | None) -> tuple[Cause, str]:
        """Why the echoed reply lost blocks the engine had cached for the generated ids."""
        if reply is None:
            return Cause.UNKNOWN, "the previous reply is not in the history"
        generated = self._tok.decode(gen)
        sent = _content_text(reply).strip()
        if "<think>" in generated and "<think>" not in sent:
            return Cause.REASONING_STRIPPED, (
                "the engine generated reasoning that the history left out"
            )
        at = generated.find(sent) if sent else -1
        if at > 0 and generated[:at].strip():
            return Cause.REASONING_STRIPPED, (
                "the reply came back without the text the engine generated before it"
            )
        if at == 0 or (sent and generated.lstrip().startswith(sent[:32])):
            ids = self._tok.encode_text(_content_text(reply))
            if ids != gen[: len(ids)]:
                return Cause.RETOKENIZATION_DRIFT, (
                    "the reply's text re-encodes to other token ids than the engine generated"
                )
        return Cause.HISTORY_EDITED, "the reply was changed before it was sent back"


def load_transcripts(
    path: Path, generated: Path | None = None
) -> dict[str, list[Turn]]:
    """Read a transcript JSONL (and optionally a generated-ids log) into sessions."""
    gen_ids: dict[tuple[str, int], tuple[int, ...]] = {}
    if generated is not None:
        for line in generated.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                gen_ids[(str(obj.get("session", "")), int(obj["turn"]))] = tuple(
                    obj["token_ids"]
                )
    sessions: dict[str, list[Turn]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if isinstance(obj, list):
            obj = {"messages": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            raise ValueError(f"{path}:{n}: expected a message list or an object with messages")
        session = str(obj.get("session", ""))
        turns = sessions.setdefault(session, [])
        ids = obj.get("generated_token_ids")
        ids = tuple(ids) if ids is not None else gen_ids.get((session, len(turns) + 1))
        tools = obj.get("tools")
        turns.append(
            Turn(
                messages=tuple(obj["messages"]),
                tools=tuple(tools) if tools is not None else None,
                chat_template_kwargs=obj.get("chat_template_kwargs"),
                generated_token_ids=ids,
            )
        )
    return sessions


def to_json(reports: Sequence[SessionReport]) -> dict[str, Any]:
    """The JSON document of a run."""
    turns = [t for r in reports for t in r.turns]
    later = [t for t in turns if t.share is not None]
    return {
        "sessions": [
            {"session": r.session, "turns": [asdict(t) for t in r.turns]} for r in reports
        ],
        "summary": {
            "turns": len(turns),
            "later_turns": len(later),
            "flagged": sum(t.flagged for t in turns),
            "causes": _count(t.divergence.cause.value for t in turns if t.divergence),
        },
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def format_table(reports: Sequence[SessionReport], block_size: int) -> str:
    """A plain-text table, one row per turn, with the divergence under flagged rows."""
    head = f"{'session':<12} {'turn':>4} {'tokens':>7} {'shared':>7} " \
        f"{'blocks':>6} {'share':>6} {'reply':>6}  cause"
    lines = [f"append-only check (block size {block_size})", head, "-" * len(head)]
    for r in reports:
        for t in r.turns:
            share = "-" if t.share is None else f"{t.share:.0%}"
            reply = "-" if t.reply_share is None else f"{t.reply_share:.0%}"
            cause = t.divergence.cause.value if t.divergence else ("" if not t.flagged else "?")
            lines.append(
                f"{r.session[:12]:<12} {t.turn:>4} {t.tokens:>7} {t.shared:>7} "
                f"{t.reusable_blocks:>6} {share:>6} {reply:>6}  {cause}"
            )
            if t.divergence:
                d = t.divergence
                where = "template" if d.message_index is None else \
                    f"message {d.message_index} ({d.message_role})"
                lines.append(f"{'':>18}first difference at token {d.position}, in {where}: "
                             f"{d.detail}")
                lines.append(f"{'':>18}before: {d.previous_text!r}")
                lines.append(f"{'':>18}now:    {d.current_text!r}")
    flagged = sum(len(r.flagged) for r in reports)
    total = sum(len(r.turns) for r in reports)
    lines.append(f"{flagged} of {total} turns under the threshold")
    return "\n".join(lines)


def _chat_body(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The chat request fields that decide a rendering, as vLLM's ``/tokenize`` takes them."""
    body: dict[str, Any] = {"messages": [dict(m) for m in messages],
                            "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        body["tools"] = [dict(t) for t in tools]
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    return body


class LocalChatTokenizer:
    """``ChatTokenizer`` over the shared ``index`` renderer: a model directory rendered
    and tokenised exactly as vLLM does (chat template, special-token rule)."""

    def __init__(self, directory: Path) -> None:
        from prompt.render import ModelRenderer
        from prompt.tokenizer import load_tokenizer_files

        self._files = load_tokenizer_files(directory)
        self._renderer = ModelRenderer(self._files)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        body = _chat_body(messages, tools, add_generation_prompt, chat_template_kwargs)
        return list(self._renderer.tokenize_chat(body).token_ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self._files.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._files.tokenizer.decode(list(ids), skip_special_tokens=False))


class HttpChatTokenizer:
    """``ChatTokenizer`` that asks a replica (vLLM or ``kvroute sim``): ``POST /tokenize``
    and ``POST /detokenize``.  Blocking calls with a timeout: for the command line only,
    never on an event loop."""

    def __init__(self, url: str, model: str | None, timeout_s: float = 30.0) -> None:
        self._url = url.rstrip("/")
        self._model = model
        self._timeout = timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.request

        if self._model is not None:
            body = {"model": self._model, **body}
        req = urllib.request.Request(
            self._url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310
            out: dict[str, Any] = json.loads(resp.read())
        return out

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        body = _chat_body(messages, tools, add_generation_prompt, chat_template_kwargs)
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def encode_text(self, text: str) -> list[int]:
        out = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return [int(t) for t in out["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(ids)})["prompt"])


def local_tokenizer(directory: Path) -> ChatTokenizer:
    """The ``index`` renderer for a model directory."""
    return LocalChatTokenizer(directory)


def http_tokenizer(url: str, model: str | None) -> ChatTokenizer:
    """A replica's ``/tokenize`` as the renderer."""
    return HttpChatTokenizer(url, model)
