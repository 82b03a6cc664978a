"""Errors raised while turning a request into a prompt (rendering, tokenising, keys).

::

    RenderError                      base; never raised itself
    ├── InvalidPrompt                the request is malformed: the engine would answer 400
    │   ├── InvalidCacheSalt         cache_salt fails vLLM's validation
    │   └── TemplateRejected         the chat template raised, or its arguments are invalid
    ├── ModelNotServed               no renderer is registered for the requested model
    ├── RenderUnsupported            local rendering cannot be exact (e.g. images, audio);
    │                                ask a replica instead
    └── RemoteRenderFailed           the replica asked to render did not answer usefully
        └── RemoteRenderTimeout      ... within the timeout

The router maps ``InvalidPrompt`` to HTTP 400 with ``param`` as the OpenAI error
``param``; ``ModelNotServed`` to 404; ``RenderUnsupported`` and ``RemoteRenderFailed``
are never client errors (the router falls back to routing without a prefix estimate).
"""

from __future__ import annotations


class RenderError(Exception):
    """Base of every error raised by rendering."""


class InvalidPrompt(RenderError):
    """The request cannot be rendered because it is malformed (HTTP 400).

    ``param`` names the offending request field when known (OpenAI's error ``param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidCacheSalt(InvalidPrompt):
    """``cache_salt`` is not a non-empty string of at most 128 characters without
    ``@``, ``/``, ``\\`` or NUL (vLLM 0.30+ ``validate_cache_salt``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="cache_salt")


class TemplateRejected(InvalidPrompt):
    """The chat template raised (``raise_exception``, a Jinja error) or refused its
    arguments (e.g. ``continue_final_message`` with ``add_generation_prompt``)."""


class ModelNotServed(RenderError):
    """No renderer is registered under the requested model name."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no renderer for model {model!r}")
        self.model = model


class RenderUnsupported(RenderError):
    """Local rendering would not be exact for this request; a replica must render it."""


class RemoteRenderFailed(RenderError):
    """A replica asked to render a prompt failed (connection, status, bad body)."""


class RemoteRenderTimeout(RemoteRenderFailed):
    """A replica asked to render a prompt did not answer within the timeout."""


__all__ = [
    "InvalidCacheSalt",
    "InvalidPrompt",
    "ModelNotServed",
    "RemoteRenderFailed",
    "RemoteRenderTimeout",
    "RenderError",
    "RenderUnsupported",
    "TemplateRejected",
]
