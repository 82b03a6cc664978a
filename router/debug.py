"""``POST /debug/route``: the routing decision for a request body, without forwarding it.

The body is a chat or completions request exactly as a client would send it (the
endpoint is taken from ``?endpoint=chat|completions``, else inferred: ``messages`` means
chat).  The same headers as on the proxy apply: the policy header picks the policy, the
session header gives the session key.  The answer::

    {"policy": "kv", "reason": "kv_hit", "replicas": ["r1", "r0", ...],
     "prompt_tokens": 1234, "predicted_cached_tokens": 1216,
     "detail": {... "replicas": [{"replica", "matched_blocks", "gpu_blocks",
                                  "cpu_blocks", "storage_blocks", "usable_blocks",
                                  "predicted_cached_tokens", "expected_cached_tokens",
                                  "p_index", "p_resident_hot", "p_resident_tail",
                                  "wait_s", "new_tokens", "queued_prefill_tokens",
                                  "decode_load", "load_known", "score"}, ...]}}

Policies with a dry run (``decide(request, candidates, commit=False)``, as ``kv`` has)
change no state: no provisional entries, no session update, no counters.  Access follows
``auth.debug_route`` (``router.tenancy.check_endpoint``: with keys configured, trusted
tenants only by default); a known tenant's ``cache_salt`` is applied as on the proxy.  Other
policies are asked through ``route`` (``dry_run: false`` in the answer: a round-robin
counter moves).  Bodies and headers are never logged.
"""

from __future__ import annotations

import os
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from router.errors import BadRequest, NoHealthyReplica, RouterError, UnknownModel, to_response
from router.policy import Endpoint, RouteRequest
from router.request import ClientDisconnected, parse_body, read_body, session_key
from router.tenancy import check_endpoint

__all__ = ["debug_route"]


async def debug_route(request: Request) -> Response:
    """Starlette endpoint (``POST /debug/route``)."""
    state = request.state
    settings = state.settings
    try:
        tenant = check_endpoint(settings.auth.debug_route, state.access,
                                request.headers.get("authorization"))
        raw = await read_body(request.receive, settings.max_body_bytes,
                              _content_length(request.headers.get("content-length")))
        endpoint = _endpoint(request.query_params.get("endpoint"), raw)
        body = parse_body(endpoint, raw)
        if tenant is not None and body is not None:
            tenant.apply_salt(body, raw)  # the salt the proxy would forward
        model = body.get("model") if body is not None else None
        session = request.headers.get(settings.session_header)
        if session is None and body is not None and isinstance(body.get("user"), str):
            session = body["user"]
        if tenant is not None and session is not None:
            session = tenant.session(session)
        override = request.headers.get(settings.policy_header)
        route = RouteRequest(
            request_id=request.headers.get("x-request-id") or os.urandom(16).hex(),
            endpoint=endpoint,
            path="/v1/chat/completions" if endpoint == "chat" else "/v1/completions",
            model=model if isinstance(model, str) else None,
            body=body,
            session_key=session_key(session),
            policy_override=override,
        )
        policies = state.policies
        policy = policies.get(override) if override else policies.default
        candidates, known = state.replicas.candidates(route.model)
        if not candidates:
            if not known:
                raise UnknownModel(state.replicas.unknown_model(route.model))
            raise NoHealthyReplica("no healthy replica can serve this request")
        decide = getattr(policy, "decide", None)
        if decide is not None:
            decision = await decide(route, candidates, commit=False)
            dry = True
        else:
            decision = await policy.route(route, candidates)
            dry = False
    except ClientDisconnected:
        return Response(status_code=499)
    except RouterError as exc:
        resp = to_response(exc)
        return Response(resp.body, status_code=resp.status, media_type="application/json",
                        headers={k.decode(): v.decode() for k, v in resp.headers})
    answer: dict[str, Any] = {
        "policy": decision.policy,
        "reason": decision.reason,
        "replicas": list(decision.replicas),
        "prompt_tokens": decision.detail.get("prompt_tokens"),
        "predicted_cached_tokens": decision.predicted_cached_tokens,
        "dry_run": dry,
        "detail": dict(decision.detail),
    }
    return Response(orjson.dumps(answer),
                    media_type="application/json")


def _content_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest("invalid Content-Length header", code="invalid_header") from None


def _endpoint(param: str | None, raw: bytes) -> Endpoint:
    if param in ("chat", "completions"):
        return param  # type: ignore[return-value]
    if param is not None:
        raise BadRequest("endpoint must be 'chat' or 'completions'", code="invalid_endpoint")
    return "chat" if b'"messages"' in raw else "completions"
