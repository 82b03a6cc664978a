"""The Jinja environment chat templates run in, and what vLLM reads from a template.

Rendering must produce the very string ``transformers``' ``apply_chat_template`` produces
in the engine's process (vLLM 0.32 ships transformers 5.19), so the environment is built
the same way:

* ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
  with the ``loopcontrols`` extension and a ``{% generation %}`` block tag (rendered as
  its body: vLLM never asks for assistant masks);
* ``tojson`` replaced by ``json.dumps(x, ensure_ascii=False, indent=..., separators=...,
  sort_keys=...)`` (Jinja's own escapes HTML characters);
* globals ``raise_exception(msg)`` (raises ``jinja2.TemplateError``) and
  ``strftime_now(fmt)`` (local wall clock, as in the engine: a template that prints the
  date renders differently across midnight, for the engine too).

Two questions vLLM answers by reading the template's AST, reproduced here rule for rule:

* :func:`detect_content_format`: ``"openai"`` when the template loops over a message's
  ``content`` (so content must stay a list of parts), else ``"string"``
  (``--chat-template-content-format auto``, ``vllm/renderers/hf.py``);
* :func:`template_variables`: the undeclared variables, which decide which
  ``chat_template_kwargs`` reach the template (``resolve_chat_template_kwargs``).

Compiled templates and both answers are cached by template source (bounded).
``message_list_names``, ``iterates_over`` and ``is_generation_block`` expose the same
AST rules (which variables alias ``messages``, which loops run over them, the
generation tag) to ``prompt.message_loop``.  This module does not touch messages or
tokens.
"""

from __future__ import annotations

import json
from collections import ChainMap, deque
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.runtime import new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]
"""How message content reaches the template: joined text, or OpenAI-style parts."""

_TEMPLATE_CACHE_SIZE = 64
"""Distinct templates compiled and kept: one or two per served model is the norm."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> Any:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment configured as transformers configures its own."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_template(template: jinja2.Template, context: dict[str, Any]) -> str:
    """``template.render(context)``, without its per-call copies of the globals.

    ``Template.render`` copies ``context``, then flattens the template's globals (a
    ``ChainMap`` iterated in Python, twice: for the context's parent and for its
    ``globals_keys``) on every call; a chat turn renders two templates (the message
    loop's and its body's).  This builds the same context from one flat dict of the
    globals, merged in C, and runs the template as ``render`` does (same output, same
    errors).  ``context`` itself is not kept or changed."""
    env = template.environment
    if env.is_async:  # never for ``make_environment``'s: render as Jinja does
        return template.render(context)
    scopes = template.globals
    if isinstance(scopes, ChainMap):  # as Jinja 3 builds them
        flat: dict[str, Any] = {}
        for scope in reversed(scopes.maps):  # ChainMap order: the first map wins
            flat.update(scope)
    else:
        flat = dict(scopes)
    ctx = new_context(env, template.name, template.blocks, {**flat, **context}, True, flat)
    try:
        return env.concat(template.root_render_func(ctx))  # type: ignore[attr-defined]
    except Exception:
        env.handle_exception()


@lru_cache(maxsize=_TEMPLATE_CACHE_SIZE)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for ``source`` (cached).

    Raises ``jinja2.TemplateSyntaxError`` for a template that does not parse.
    """
    return make_environment().from_string(source)


@lru_cache(maxsize=_TEMPLATE_CACHE_SIZE)
def template_variables(source: str) -> frozenset[str]:
    """Variables the template reads without defining them (``jinja2.meta``)."""
    env = make_environment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


@lru_cache(maxsize=_TEMPLATE_CACHE_SIZE)
def detect_content_format(source: str) -> ContentFormat:
    """``"openai"`` when the template iterates over message content, else ``"string"``.

    A template that does not parse counts as ``"string"`` (vLLM's default).
    """
    try:
        ast = make_environment().parse(source)
    except jinja2.TemplateError:
        return "string"
    try:
        for _ in _content_loops(ast):
            return "openai"
    except _UnexpectedShape:
        return "string"
    return "string"


# --- AST rules (vLLM 0.32 ``_iter_nodes_assign_content_item`` and helpers) -------------
# vLLM asserts that the variables it tracks are plain names; a template that unpacks one
# (``for i, m in messages|enumerate``) fails the assertion and falls back to "string".


class _UnexpectedShape(Exception):
    pass


def _target_name(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _UnexpectedShape
    return node.name


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _refers_to(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _refers_to(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _refers_to(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _refers_to(node.node, name, key)
    return _is_item(node, name, key) if key else _is_name(node, name)


def _aliases(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (transitively, breadth first)."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _refers_to(assign.node, current):
                target = _target_name(assign.target)
                yield target
                if target != current:
                    pending.append(target)


def message_list_names(root: jinja2.nodes.Node) -> frozenset[str]:
    """``messages`` and every variable the template assigns from it (vLLM's alias rule).

    Raises ``ValueError`` for an assignment target that is not a plain name (vLLM's
    assertion).
    """
    try:
        return frozenset(_aliases(root, "messages"))
    except _UnexpectedShape as exc:
        raise ValueError("an alias of messages is assigned to a non-name target") from exc


def iterates_over(loop: jinja2.nodes.For, names: frozenset[str]) -> bool:
    """``loop`` iterates over one of ``names`` (possibly filtered, tested or sliced)."""
    return any(_refers_to(loop.iter, n) for n in names)


def is_generation_block(node: jinja2.nodes.Node) -> bool:
    """``node`` is a ``{% generation %}`` block (which renders its body unchanged)."""
    if not isinstance(node, jinja2.nodes.CallBlock) or not isinstance(node.call, jinja2.nodes.Call):
        return False
    attr = node.call.node
    return (
        isinstance(attr, jinja2.nodes.ExtensionAttribute)
        and attr.identifier == _GenerationTag.identifier
        and attr.name == "_render_body"
    )


def _message_loop_targets(root: jinja2.nodes.Node) -> Iterator[str]:
    """Loop variables of ``for m in messages`` (or an alias of ``messages``)."""
    names = list(_aliases(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_refers_to(loop.iter, n) for n in names):
            yield _target_name(loop.target)


def _content_loops(root: jinja2.nodes.Node) -> Iterator[jinja2.nodes.For]:
    message_names = list(_message_loop_targets(root))
    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    calls = list(root.find_all(jinja2.nodes.Call))
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = [arg.name for arg in macro.args]
        content_params: set[str] = set()
        for call in calls:
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(param_names) and any(
                    _refers_to(arg, m, "content") for m in message_names
                ):
                    content_params.add(param_names[i])
            for kw in call.kwargs:
                if kw.key in param_names and any(
                    _refers_to(kw.value, m, "content") for m in message_names
                ):
                    content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_refers_to(loop.iter, m, "content") for m in message_names):
            _target_name(loop.target)
            yield loop
            continue
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                _target_name(loop.target)
                yield loop
            elif id(loop) not in loops_in_macros and loop.iter.name == "content":
                _target_name(loop.target)
                yield loop


__all__ = [
    "ContentFormat",
    "compile_template",
    "detect_content_format",
    "is_generation_block",
    "iterates_over",
    "make_environment",
    "message_list_names",
    "render_template",
    "template_variables",
]
