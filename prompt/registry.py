"""Served model names to renderers: one registry per router, several models each.

A request's ``model`` is either a served model name (:class:`ModelSpec`) or a LoRA
adapter name served on top of one (``ModelSpec.loras`` or :meth:`RendererRegistry.add_lora`).
Either way the registry knows:

* the renderer (tokenizer + templates + the replica's rendering flags), or that there
  is none locally (``ModelSpec.tokenizer=None``: prompts are rendered by a replica);
* the block size of the base model (vLLM's ``--block-size``; never guessed);
* the key chain: ``model`` = the *base* served name, ``lora_name`` = the adapter name on
  every block (vLLM folds the adapter name into every block hash), ``cache_salt`` on
  block 0.

``render_chat(body)`` / ``render_completion(body)`` are synchronous and local: they raise
``RenderUnsupported`` when local rendering is impossible or would not be exact.  The
next turn of a conversation reuses what the previous one computed, up to its block keys
(``ModelRenderer.render_chat``; one ``prompt.conversation`` memo per model, one key
memo per registry).
``chat(body, replica_url=...)`` / ``completion(...)`` are the async front doors: local
when possible, else the ``RemoteRenderer`` given at construction (counted as a
fallback there).  ``cache_salt`` is validated first in every path (``InvalidCacheSalt``).

Loading a model reads files (blocking): build the registry at startup.  The registry
is not thread-safe; it belongs to the router's event loop, and rendering never awaits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvkeys.keys import block_keys
from prompt.chat_options import ContentFormatOption, RenderOptions
from prompt.conversation import DEFAULT_MAX_TURN_BYTES
from prompt.errors import InvalidPrompt, ModelNotServed, RenderUnsupported
from prompt.keyer import DEFAULT_MAX_KEY_NODES, KeyContext, Prompt, PromptKeyer, validate_cache_salt
from prompt.render import Keying, ModelRenderer, Tokenized
from prompt.segments import DEFAULT_MAX_CACHED_TOKENS
from prompt.tokenizer import load_tokenizer_files, read_chat_template
from prompt.words import DEFAULT_MAX_WORDS

if TYPE_CHECKING:
    from prompt.remote_render import RemoteRenderer


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model as the router knows it (from the router's settings)."""

    name: str
    """The served model name clients put in ``model``."""
    block_size: int
    """The replica's KV block size for this model (``--block-size``; 16 on GPU by
    default, 128 on vLLM's CPU build)."""
    tokenizer: str | Path | None = None
    """Local directory or Hugging Face repository id (local cache only); ``None``
    means no local tokenizer: prompts are rendered by a replica."""
    revision: str | None = None
    chat_template: str | None = None
    """``--chat-template``: a file path, a template literal or a template name."""
    content_format: ContentFormatOption = "auto"
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    max_model_len: int | None = None
    loras: tuple[str, ...] = ()
    """LoRA adapter names served on top of this model (``--lora-modules name=path``)."""

    def render_options(self) -> RenderOptions:
        """The rendering flags of this model's replicas."""
        template = self.chat_template
        if template is not None and ("{" in template or Path(template).expanduser().is_file()):
            template = read_chat_template(template)
        return RenderOptions(
            chat_template=template,
            content_format=self.content_format,
            default_chat_template_kwargs=dict(self.default_chat_template_kwargs),
            trust_request_chat_template=self.trust_request_chat_template,
            exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
            max_model_len=self.max_model_len,
        )


@dataclass(frozen=True, slots=True)
class Target:
    """What a request's ``model`` resolves to."""

    spec: ModelSpec
    """The base model's spec."""
    lora_name: str | None
    renderer: ModelRenderer | None
    """``None`` when the base model has no local tokenizer."""

    def key_context(self, cache_salt: str | None) -> KeyContext:
        """The key chain parameters of a request to this target."""
        return KeyContext(
            model=self.spec.name,
            block_size=self.spec.block_size,
            cache_salt=cache_salt,
            lora_name=self.lora_name,
        )


@dataclass(slots=True)
class RegistryStats:
    """Counters the router exports (plain ints, read on scrape)."""

    local_chat: int = 0
    local_completion: int = 0
    remote_chat: int = 0
    remote_completion: int = 0


class RendererRegistry:
    """Model name -> renderer, block size and key chain parameters."""

    def __init__(
        self,
        specs: Iterable[ModelSpec] = (),
        *,
        hf_cache_dir: str | Path | None = None,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        max_key_nodes: int = DEFAULT_MAX_KEY_NODES,
        max_turn_bytes: int = DEFAULT_MAX_TURN_BYTES,
        max_cached_words: int = DEFAULT_MAX_WORDS,
        remote: RemoteRenderer | None = None,
    ) -> None:
        self._hf_cache_dir = hf_cache_dir
        self._max_cached_tokens = max_cached_tokens
        self._max_turn_bytes = max_turn_bytes
        self._max_cached_words = max_cached_words
        self._targets: dict[str, Target] = {}
        self.keyer = PromptKeyer(max_nodes=max_key_nodes)
        self.remote = remote
        self.stats = RegistryStats()
        for spec in specs:
            self.add(spec)

    # -- configuration ------------------------------------------------------------------

    def add(self, spec: ModelSpec, *, renderer: ModelRenderer | None = None) -> Target:
        """Register ``spec`` (and its LoRA names); loads its tokenizer unless given."""
        if spec.block_size <= 0:
            raise ValueError(f"block_size of {spec.name} must be positive")
        if spec.name in self._targets:
            raise ValueError(f"model {spec.name!r} is already registered")
        if renderer is None and spec.tokenizer is not None:
            files = load_tokenizer_files(
                spec.tokenizer, cache_dir=self._hf_cache_dir, revision=spec.revision
            )
            renderer = ModelRenderer(
                files,
                spec.render_options(),
                max_cached_tokens=self._max_cached_tokens,
                max_turn_bytes=self._max_turn_bytes,
                max_cached_words=self._max_cached_words,
            )
            renderer.warm()
        target = Target(spec=spec, lora_name=None, renderer=renderer)
        self._targets[spec.name] = target
        for lora in spec.loras:
            self.add_lora(lora, base=spec.name)
        return target

    def add_lora(self, lora_name: str, *, base: str) -> Target:
        """Serve adapter ``lora_name`` on top of registered model ``base``."""
        if lora_name in self._targets:
            raise ValueError(f"model {lora_name!r} is already registered")
        base_target = self._targets.get(base)
        if base_target is None or base_target.lora_name is not None:
            raise ValueError(f"LoRA base {base!r} is not a registered base model")
        target = Target(spec=base_target.spec, lora_name=lora_name, renderer=base_target.renderer)
        self._targets[lora_name] = target
        return target

    def resolve(self, model: object) -> Target:
        """The target of a request's ``model``; raises ``ModelNotServed``."""
        if not isinstance(model, str):
            raise InvalidPrompt("'model' must be a string", param="model")
        target = self._targets.get(model)
        if target is None:
            raise ModelNotServed(model)
        return target

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and model in self._targets

    def models(self) -> list[str]:
        """Every servable name (base models and adapters)."""
        return list(self._targets)

    # -- local rendering ----------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any]) -> Prompt:
        """The prompt of a ``/v1/chat/completions`` body, rendered locally."""
        target = self.resolve(body.get("model"))
        return self._render_chat(body, target, validate_cache_salt(body.get("cache_salt")))

    def _render_chat(self, body: Mapping[str, Any], target: Target, salt: str | None) -> Prompt:
        """``render_chat`` for the body's resolved target and checked salt."""
        renderer = _local(target)
        ctx = target.key_context(salt)
        prompt = self._prompt(ctx, salt, renderer.render_chat(body, Keying(self.keyer, ctx)))
        self.stats.local_chat += 1
        return prompt

    def render_completion(self, body: Mapping[str, Any]) -> list[Prompt]:
        """The prompts of a ``/v1/completions`` body (one per batched prompt), locally."""
        target = self.resolve(body.get("model"))
        return self._render_completion(body, target,
                                       validate_cache_salt(body.get("cache_salt")))

    def _render_completion(
        self, body: Mapping[str, Any], target: Target, salt: str | None
    ) -> list[Prompt]:
        """``render_completion`` for the body's resolved target and checked salt."""
        renderer = _local(target)
        ctx = target.key_context(salt)
        prompts = [self._prompt(ctx, salt, t) for t in renderer.tokenize_completion(body)]
        self.stats.local_completion += 1
        return prompts

    def prompt_from_tokens(
        self, model: str, token_ids: list[int], *, cache_salt: str | None = None
    ) -> Prompt:
        """A prompt for token ids obtained elsewhere (a replica, an event)."""
        target = self.resolve(model)
        salt = validate_cache_salt(cache_salt)
        return self._prompt(target.key_context(salt), salt, Tokenized(token_ids, None),
                            source="remote")

    def _prompt(
        self, ctx: KeyContext, salt: str | None, tok: Tokenized, *, source: str = "local"
    ) -> Prompt:
        """The prompt of ``tok`` keyed under ``ctx`` (the target's context for ``salt``)."""
        if tok.block_keys is not None:
            keys = tok.block_keys
        elif tok.segments is not None:
            keys = self.keyer.keys(ctx, tok.segments)
        else:
            keys = block_keys(
                tok.token_ids,
                ctx.block_size,
                model=ctx.model,
                cache_salt=salt,
                lora_name=ctx.lora_name,
            )
        return Prompt(
            token_ids=tok.token_ids,
            block_keys=keys,
            block_size=ctx.block_size,
            model=ctx.model,
            lora_name=ctx.lora_name,
            cache_salt=salt,
            source="remote" if source == "remote" else "local",
        )

    # -- local, else remote -------------------------------------------------------------

    async def chat(self, body: Mapping[str, Any], *, replica_url: str | None = None) -> Prompt:
        """Local rendering when possible, else ask the replica at ``replica_url``."""
        target = self.resolve(body.get("model"))
        salt = validate_cache_salt(body.get("cache_salt"))
        if target.renderer is not None:
            try:
                return self._render_chat(body, target, salt)
            except RenderUnsupported:
                pass
        remote = self._remote(replica_url)
        prompt = await remote.render_chat(
            replica_url or "",
            body,
            target.key_context(salt),
            exclude_tools_when_tool_choice_none=target.spec.exclude_tools_when_tool_choice_none,
        )
        self.stats.remote_chat += 1
        return prompt

    async def completion(
        self, body: Mapping[str, Any], *, replica_url: str | None = None
    ) -> list[Prompt]:
        """Local rendering when possible, else ask the replica at ``replica_url``."""
        target = self.resolve(body.get("model"))
        salt = validate_cache_salt(body.get("cache_salt"))
        if target.renderer is not None:
            try:
                return self._render_completion(body, target, salt)
            except RenderUnsupported:
                pass
        remote = self._remote(replica_url)
        prompts = await remote.render_completion(replica_url or "", body, target.key_context(salt))
        self.stats.remote_completion += 1
        return prompts

    def _remote(self, replica_url: str | None) -> RemoteRenderer:
        if self.remote is None or replica_url is None:
            raise RenderUnsupported("no local renderer and no replica to ask")
        return self.remote


def _local(target: Target) -> ModelRenderer:
    if target.renderer is None:
        raise RenderUnsupported(f"no local tokenizer for model {target.spec.name!r}")
    return target.renderer


__all__ = ["ModelSpec", "RegistryStats", "RendererRegistry", "Target"]
