"""A chat template's message loop, rendered one message at a time and remembered.

Most chat templates are a preamble, ``{% for message in messages %}BODY{% endfor %}``
and a generation prompt.  When BODY's output for a message depends only on that
message, on its position and on variables that stay the same through the loop, the
loop's output is the concatenation of BODY rendered for each message on its own, and
the next turn of a conversation only needs BODY for its new messages.
``message_loops(source)`` proves this for each loop over ``messages`` (or an alias),
rule by rule on the template's AST, and compiles two things per qualifying loop:

* the template, with the loop replaced by a call that returns the loop's output,
  given the iterable and the values of BODY's free variables, evaluated where the loop
  stood;
* BODY as a template of its own, inside ``{% for TARGET, POS in items %}`` (so scoping,
  ``continue`` and the loop variable behave as in place), ``loop.first``,
  ``loop.index`` and ``loop.index0`` read from ``POS``.

A loop qualifies when:

* it is ``{% for NAME in X %}`` over ``messages`` or an alias, with no ``else``, no
  filter, not ``recursive``, and not inside another loop, a macro or a call block (so
  it runs at most once per rendering);
* at its own level BODY reads ``loop`` only as ``loop.first``, ``loop.index`` or
  ``loop.index0`` (never ``last``, ``length``, ``nextitem``...: they depend on the
  messages after this one); inside nested loops ``loop`` is theirs;
* BODY never reads ``messages`` or an alias, has no ``break`` at its own level, no
  namespace assignment, no macro, include, import, block or call block other than
  ``{% generation %}``, and no ``strftime_now``, ``lipsum``, ``random`` or ``sameas``
  (time, chance, identity).

Jinja resets a loop body's own variables at each iteration, so the iterations share
nothing else.  A rendering returns a ``LoopRecord`` per loop: the elements (held, and
compared, by identity), where each one's output ends, and the free variables' values
as ``prompt.plain_data`` bytes.  A later rendering given that record reuses the outputs
of its leading elements that are the very same objects, in the same positions, under
equal free variables, and renders the rest with BODY (several messages in one call,
cut apart at a separator that cannot occur unnoticed).  The caller keeps the
conversation's message objects unchanged between renderings (``prompt.conversation``), so
identity implies the same content.

At render time the call raises ``LoopFallback`` when it cannot be exact: the iterable
is not a list, or a free variable's value is not plain data (a namespace, a macro, an
undefined value with a hint).  The caller then renders the original template.
Templates with no qualifying loop have ``template = None`` and ``reason`` says why.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.nodes as jn
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

from prompt.plain_data import plain_bytes
from prompt.template_env import (
    is_generation_block,
    iterates_over,
    make_environment,
    message_list_names,
    render_template,
)

_CALL = "kvroute_loop__"
_ITEMS = "kvroute_items__"
_POS = "kvroute_pos__"
_CUT = "kvroute_cut__"
_RESERVED = frozenset({_CALL, _ITEMS, _POS, _CUT})
_SEPARATOR = "\x00kvroute-message-loop\x01"
"""Emitted before each element's output when several are rendered in one call.  Its
first character occurs nowhere else in it, so occurrences cannot overlap: if the output
holds exactly one per element, none came from a message."""
_POSITION_ATTRS = frozenset({"first", "index", "index0"})
_FORBIDDEN_NAMES = frozenset({"strftime_now", "lipsum", "self", "super"})
_FORBIDDEN_FILTERS = frozenset({"random"})
_FORBIDDEN_TESTS = frozenset({"sameas"})
_ALLOWED_STATEMENTS = (
    jn.Output,
    jn.If,
    jn.For,
    jn.Assign,
    jn.AssignBlock,
    jn.With,
    jn.FilterBlock,
    jn.Continue,
    jn.Break,
)
_FORBIDDEN_EXPRESSIONS = (
    jn.NSRef,
    jn.ContextReference,
    jn.DerivedContextReference,
    jn.InternalName,
    jn.ImportedName,
    jn.EnvironmentAttribute,
    jn.ExtensionAttribute,
)
_TEMPLATE_WIDE_UNSUPPORTED = (jn.Extends, jn.Include, jn.Import, jn.FromImport)
_TEMPLATE_CACHE_SIZE = 64
_FORBIDDEN = -1  # depth at which any use of ``loop`` is refused


class LoopFallback(Exception):
    """This rendering cannot use the memoised loop; render the original template."""


@dataclass(frozen=True, slots=True)
class LoopRecord:
    """The output of one message loop in one rendering."""

    owner: MessageLoops
    index: int
    """Which loop of the template (in source order)."""
    key: bytes
    """The free variables' values (``prompt.plain_data``)."""
    items: list[Any]
    """The loop's elements, held so that identity comparisons stay sound."""
    ends: list[int]
    """``text[:ends[i]]`` is the output of ``items[: i + 1]``."""
    text: str


class _Position:
    """What BODY reads as ``loop.first``, ``loop.index`` and ``loop.index0``."""

    __slots__ = ("index0",)

    def __init__(self, index0: int) -> None:
        self.index0 = index0

    @property
    def index(self) -> int:
        return self.index0 + 1

    @property
    def first(self) -> bool:
        return self.index0 == 0


class _Impure(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Loop:
    free: tuple[str, ...]
    """BODY's free variables, in the order the call passes their values."""
    body: jinja2.Template
    keys: dict[tuple[tuple[Any, ...], ...], bytes]
    """Record keys of free variables that are all undefined or globals (by name)."""

    def render_items(
        self, items: list[tuple[Any, _Position]], context: dict[str, Any]
    ) -> list[str]:
        if not items:
            return []
        body = self.body
        context[_ITEMS] = items
        context[_CUT] = _SEPARATOR
        out = render_template(body, context)
        parts = out.split(_SEPARATOR)
        if len(parts) == len(items) + 1 and not parts[0]:
            return parts[1:]
        # A message produced the separator itself: render the elements one by one.
        outputs = []
        for item in items:
            context[_ITEMS] = [item]
            context[_CUT] = ""
            outputs.append(render_template(body, context))
        return outputs


class MessageLoops:
    """A chat template whose qualifying message loops render one message at a time."""

    def __init__(self, source: str, env: ImmutableSandboxedEnvironment | None = None) -> None:
        self.env = env or make_environment()
        self._loops: list[_Loop] = []
        self.template: jinja2.Template | None = None
        self._main: jinja2.Template | None = None
        self.reason: str | None = None
        try:
            self._compile(source)
        except _Impure as exc:
            self.reason = str(exc)
        except (jinja2.TemplateError, ValueError) as exc:
            self.reason = f"template not analysable: {exc}"

    @property
    def loop_count(self) -> int:
        """How many message loops render one message at a time."""
        return len(self._loops)

    def render(
        self, context: dict[str, Any], base: Sequence[LoopRecord] = ()
    ) -> tuple[str, list[LoopRecord]]:
        """The template's output for ``context``, reusing ``base`` where it applies.

        Raises ``LoopFallback`` (render the original template instead) and whatever
        the template raises.
        """
        if self._main is None:
            raise LoopFallback(self.reason or "no message loop")
        run = _Run(self, base)
        text = render_template(self._main, {**context, _CALL: run.call})
        return text, run.records

    # -- analysis -----------------------------------------------------------------------

    def _compile(self, source: str) -> None:
        env = self.env
        main = env.parse(source)
        if any(True for _ in main.find_all(_TEMPLATE_WIDE_UNSUPPORTED)):
            raise _Impure("the template extends, includes or imports templates")
        if any(n.name in _RESERVED for n in main.find_all(jn.Name)):
            raise _Impure("the template uses a name reserved for the loop memo")
        aliases = message_list_names(main)
        stateful = _macros_and_namespaces(main)
        bodies = env.parse(source)  # a second copy, whose loop bodies become templates
        replacements: dict[int, jn.Node] = {}
        reasons: list[str] = []
        pairs = zip(_loops_over(main, aliases), _loops_over(bodies, aliases), strict=True)
        for loop, twin in pairs:
            try:
                free = _check_loop(twin, aliases)
                if stateful.intersection(free):
                    name = min(stateful.intersection(free))
                    raise _Impure(f"the message loop's body reads macro or namespace {name!r}")
            except _Impure as exc:
                reasons.append(str(exc))
                continue
            index = len(self._loops)
            assert isinstance(twin.target, jn.Name)  # checked by _check_loop
            self._loops.append(_Loop(free, _body_template(env, twin), {}))
            call = jn.Call(
                jn.Name(_CALL, "load"),
                [jn.Const(index), loop.iter, *(jn.Name(n, "load") for n in free)],
                [],
                None,
                None,
            )
            output = jn.Output([call])
            output.set_lineno(loop.lineno)
            output.set_environment(env)
            replacements[id(loop)] = output
        if not replacements:
            raise _Impure("; ".join(reasons) or "no loop over messages")
        _replace(main, replacements)
        self.template = self._main = env.from_string(main)


def _loops_over(root: jn.Node, aliases: frozenset[str]) -> Iterator[jn.For]:
    """Loops over ``aliases`` that run at most once per rendering, in source order."""
    for child in root.iter_child_nodes():
        if isinstance(child, jn.For):
            if iterates_over(child, aliases):
                yield child
        elif not isinstance(child, (jn.Macro, jn.CallBlock)):
            yield from _loops_over(child, aliases)


def _macros_and_namespaces(root: jn.Node) -> frozenset[str]:
    """Names the template binds to a macro or a ``namespace()``: values that are not
    plain data, so a loop body reading one could never be reused (decided here rather
    than by a fallback at every rendering)."""
    names = {m.name for m in root.find_all(jn.Macro)}
    for assign in root.find_all(jn.Assign):
        value = assign.node
        if (
            isinstance(assign.target, jn.Name)
            and isinstance(value, jn.Call)
            and isinstance(value.node, jn.Name)
            and value.node.name == "namespace"
        ):
            names.add(assign.target.name)
    return frozenset(names)


def _check_loop(loop: jn.For, aliases: frozenset[str]) -> tuple[str, ...]:
    """BODY's free variables if the loop qualifies (module doc), else ``_Impure``.

    Renames ``loop.first``/``index``/``index0`` at BODY's level to ``POS`` (``loop``
    is the copy that becomes BODY's template).
    """
    if not isinstance(loop.target, jn.Name) or loop.target.name == "loop":
        raise _Impure("the message loop unpacks its target")
    if loop.else_ or loop.test is not None or loop.recursive:
        raise _Impure("the message loop has an else block, a filter or recursion")
    loads: set[str] = set()
    renames: list[jn.Name] = []
    for node in loop.body:
        _check(node, 0, aliases, loads, renames)
    for name in renames:
        name.name = _POS
    loads.discard(loop.target.name)
    return tuple(sorted(loads))


def _check(
    node: jn.Node, depth: int, aliases: frozenset[str], loads: set[str], renames: list[jn.Name]
) -> None:
    """Walk BODY: ``depth`` 0 is BODY's own level, >0 inside nested loops' bodies."""
    if isinstance(node, jn.Name):
        if node.name == "loop":
            if node.ctx != "load" or depth <= 0:
                raise _Impure("the message loop's body uses `loop` beyond first/index/index0")
            return
        if node.ctx == "load":
            if node.name in aliases:
                raise _Impure(f"the message loop's body reads {node.name!r}")
            if node.name in _FORBIDDEN_NAMES:
                raise _Impure(f"the message loop's body uses {node.name!r}")
            loads.add(node.name)
        return
    if (
        isinstance(node, jn.Getattr)
        and isinstance(node.node, jn.Name)
        and node.node.name == "loop"
        and depth == 0
    ):
        if node.node.ctx != "load" or node.attr not in _POSITION_ATTRS:
            raise _Impure(f"the message loop's body reads loop.{node.attr}")
        renames.append(node.node)
        return
    if isinstance(node, jn.Stmt):
        if is_generation_block(node):
            assert isinstance(node, jn.CallBlock)
            for child in node.body:
                _check(child, _FORBIDDEN if depth == 0 else depth, aliases, loads, renames)
            return
        if not isinstance(node, _ALLOWED_STATEMENTS):
            raise _Impure(f"the message loop's body has a {type(node).__name__} statement")
        if isinstance(node, jn.Break) and depth <= 0:
            raise _Impure("the message loop's body breaks out of the loop")
        if isinstance(node, jn.For):
            _check(node.target, depth, aliases, loads, renames)
            _check(node.iter, depth, aliases, loads, renames)
            if node.test is not None:
                _check(node.test, depth, aliases, loads, renames)
            for child in node.else_:
                _check(child, depth, aliases, loads, renames)
            inner = depth + 1 if depth >= 0 else _FORBIDDEN
            for child in node.body:
                _check(child, inner, aliases, loads, renames)
            return
    elif isinstance(node, _FORBIDDEN_EXPRESSIONS):
        raise _Impure(f"the message loop's body has a {type(node).__name__} expression")
    elif isinstance(node, jn.Filter) and node.name in _FORBIDDEN_FILTERS:
        raise _Impure(f"the message loop's body uses the {node.name!r} filter")
    elif isinstance(node, jn.Test) and node.name in _FORBIDDEN_TESTS:
        raise _Impure(f"the message loop's body uses the {node.name!r} test")
    for child in node.iter_child_nodes():
        _check(child, depth, aliases, loads, renames)


def _body_template(env: ImmutableSandboxedEnvironment, loop: jn.For) -> jinja2.Template:
    """``{% for TARGET, POS in items %}{{ cut }}BODY{% endfor %}``."""
    assert isinstance(loop.target, jn.Name)
    wrapper = jn.For(
        jn.Tuple([jn.Name(loop.target.name, "store"), jn.Name(_POS, "store")], "store"),
        jn.Name(_ITEMS, "load"),
        [jn.Output([jn.Name(_CUT, "load")]), *loop.body],
        [],
        None,
        False,
    )
    template = jn.Template([wrapper])
    template.set_lineno(loop.lineno)
    template.set_environment(env)
    return env.from_string(template)


def _replace(node: jn.Node, replacements: dict[int, jn.Node]) -> None:
    for _, value in node.iter_fields():
        if isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, jn.Node):
                    continue
                if id(item) in replacements:
                    value[i] = replacements[id(item)]
                else:
                    _replace(item, replacements)
        elif isinstance(value, jn.Node):
            _replace(value, replacements)


class _Run:
    """One rendering: the records it may reuse and the records it produces."""

    __slots__ = ("_base", "_owner", "records")

    def __init__(self, owner: MessageLoops, base: Sequence[LoopRecord]) -> None:
        self._owner = owner
        self._base = base
        self.records: list[LoopRecord] = []

    def call(self, index: int, seq: object, *values: object) -> str:
        """What the template calls where loop ``index`` stood."""
        owner = self._owner
        loop = owner._loops[index]
        if type(seq) is not list:
            raise LoopFallback("the message loop's iterable is not a list")
        context, key = _free_values(owner.env, loop, values)
        base = next(
            (r for r in self._base if r.owner is owner and r.index == index and r.key == key),
            None,
        )
        shared = 0
        if base is not None:
            shared = min(len(seq), len(base.items))
            if not all(map(operator.is_, seq, base.items)):
                shared = list(map(operator.is_, seq, base.items)).index(False)
        if shared:
            assert base is not None
            ends = base.ends[:shared]
            prefix = base.text if ends[-1] == len(base.text) else base.text[: ends[-1]]
        else:
            ends, prefix = [], ""
        items = [(seq[i], _Position(i)) for i in range(shared, len(seq))]
        outputs = loop.render_items(items, context)
        end = len(prefix)
        for out in outputs:
            end += len(out)
            ends.append(end)
        text = "".join([prefix, *outputs]) if outputs else prefix
        self.records.append(LoopRecord(owner, index, key, list(seq), ends, text))
        return text


def _free_values(
    env: ImmutableSandboxedEnvironment, loop: _Loop, values: tuple[object, ...]
) -> tuple[dict[str, Any], bytes]:
    """BODY's context and the record key for the free variables' values.

    An undefined variable is left out of the context (BODY sees it undefined, as in
    place) and an unshadowed global is left to the environment; both enter the key by
    name only (so such keys are kept per loop instead of serialised again).
    """
    context: dict[str, Any] = {}
    parts: list[tuple[Any, ...]] = []
    for name, value in zip(loop.free, values, strict=True):
        if isinstance(value, jinja2.Undefined):
            if (
                type(value) is not env.undefined
                or value._undefined_name != name
                or value._undefined_hint is not None
                or value._undefined_obj is not missing
            ):
                raise LoopFallback(f"{name!r} is undefined in an unusual way")
            parts.append(("undefined", name))
        elif name in env.globals and value is env.globals[name]:
            parts.append(("global", name))
        else:
            parts.append(("value", name, value))
            context[name] = value
    if not context:  # names only: the same key as last time
        by_name = tuple(parts)
        key = loop.keys.get(by_name)
        if key is None:
            key = plain_bytes(parts)
            assert key is not None  # tuples of strings are plain data
            loop.keys[by_name] = key
        return context, key
    plain = plain_bytes(parts)
    if plain is None:
        raise LoopFallback("a free variable of the message loop is not plain data")
    return context, plain


@lru_cache(maxsize=_TEMPLATE_CACHE_SIZE)
def message_loops(source: str) -> MessageLoops:
    """The analysed template for ``source`` (cached, like ``compile_template``)."""
    return MessageLoops(source)


__all__ = ["LoopFallback", "LoopRecord", "MessageLoops", "message_loops"]
