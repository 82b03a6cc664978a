"""The admin API (FastAPI): replicas at run time, the debug route and the metrics.

Served on its own listener (``router.admin_server``; ``admin.host``/``admin.port``,
loopback by default, off unless ``admin.enabled``), never on the proxy's: the proxy's
hot path stays a raw ASGI handler.  Typed request and response models; the OpenAPI
description is at ``/openapi.json`` and the interactive page at ``/docs``.

Routes:

* ``GET /admin/replicas``: every member, with its state (``healthy``, ``draining``,
  ``unhealthy``), the sources that claim it and its in-flight count.
* ``POST /admin/replicas`` (a ``ReplicaSettings`` body): the replica joins (source
  ``admin``); it gets traffic once a health probe succeeds.  201 when it joined, 200 when
  it was already a member (the claim is recorded), 409 when its id is a member with
  another URL.
* ``DELETE /admin/replicas/{id}``: drop the ``admin`` and ``static`` claims; with no
  claim left the replica drains and leaves (202).  404 for an unknown id; 409 when the
  membership file or DNS still lists it (change it there).
* ``POST /debug/route`` (as on the main listener) and ``GET /metrics``.

Authentication: with ``admin.key_sha256`` set, every route but ``/docs`` and
``/openapi.json`` needs ``Authorization: Bearer KEY`` whose SHA-256 matches (compared in
constant time); otherwise 401 with an OpenAI-shaped error.  Errors are OpenAI-shaped
(``{"error": {"message", "type", "code"}}``), validation errors included (422).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.responses import Response

from kvkeys.types import ReplicaId
from router.config import ReplicaSettings
from router.debug import debug_route
from router.errors import error_body

__all__ = ["ReplicaList", "ReplicaOut", "build_admin_app"]


class ReplicaOut(BaseModel):
    """One member replica."""

    id: str
    url: str
    state: Literal["healthy", "draining", "unhealthy"]
    sources: list[Literal["static", "file", "dns", "admin"]]
    """Where the replica comes from (several sources may list it)."""
    models: list[str] | None
    """Models served (configured or discovered); ``None``: not known yet."""
    in_flight: int
    """Requests this router has in flight on it."""


class ReplicaList(BaseModel):
    """Every member replica, as the answering router process sees it."""

    replicas: list[ReplicaOut]
    worker: int = Field(description="The answering process (``kvroute serve --workers N``: "
                        "0 to N-1; each has its own view).")


class Removal(BaseModel):
    """A replica that is leaving."""

    id: str
    state: Literal["draining"] = "draining"
    drain_timeout_s: float = Field(description="The longest its in-flight requests get.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class ErrorBody(BaseModel):
    """OpenAI-shaped error."""

    error: ErrorDetail


class AdminError(Exception):
    """An admin request that fails: status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, code: str,
                 type_: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong admin key."},
}


def build_admin_app(state: Mapping[str, Any], *, worker: int = 0) -> FastAPI:
    """The admin app over the main app's lifespan ``state`` (``router.app.State``);
    ``worker`` is the process's index under ``--workers``."""
    settings = state["settings"]
    key_hash: str | None = settings.admin.key_sha256
    bearer = HTTPBearer(auto_error=False, description="The admin key (admin.key_sha256)")

    # A default, not ``Annotated``: this module's annotations are strings, and FastAPI
    # resolves them in the module's globals, where ``bearer`` is not.
    async def authorize(
        creds: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        if key_hash is None:
            return
        given = creds.credentials if creds is not None else ""
        digest = hashlib.sha256(given.encode()).hexdigest()
        if not given or not hmac.compare_digest(digest, key_hash):
            raise AdminError(401, "missing or invalid admin key", "invalid_api_key")

    app = FastAPI(title="kvroute admin", version="1", dependencies=[Depends(authorize)],
                  responses=_ERRORS)

    @app.exception_handler(AdminError)
    async def admin_error(request: Request, exc: AdminError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return Response(error_body(exc.message, exc.type, exc.code), status_code=exc.status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                            for e in exc.errors())
        return Response(error_body(message, "invalid_request_error", "invalid_value"),
                        status_code=422, media_type="application/json")

    replicas = state["replicas"]
    membership = state["membership"]
    load = state["load"]

    def out(rid: ReplicaId) -> ReplicaOut:
        st = replicas[rid]
        return ReplicaOut(id=rid, url=st.url, state=st.member_state,
                          sources=list(membership.sources(rid)),
                          models=list(st.models) if st.models is not None else None,
                          in_flight=load.in_flight(rid))

    @app.get("/admin/replicas", tags=["replicas"])
    async def list_replicas() -> ReplicaList:
        """Every member replica and its state."""
        return ReplicaList(replicas=[out(r) for r in replicas.ids], worker=worker)

    @app.post("/admin/replicas", tags=["replicas"], status_code=201,
              responses={200: {"model": ReplicaOut, "description": "Already a member."},
                         409: {"model": ErrorBody, "description": "Id taken by another URL."}})
    async def add_replica(replica: ReplicaSettings) -> Response:
        """Add a replica (it gets traffic once healthy)."""
        change = membership.add("admin", replica)
        if change.refused:
            raise AdminError(409, change.refused[0], "replica_conflict")
        rid = ReplicaId(replica.id)
        body = out(rid).model_dump_json().encode()
        return Response(body, status_code=201 if change.added else 200,
                        media_type="application/json")

    @app.delete("/admin/replicas/{replica_id}", tags=["replicas"], status_code=202,
                responses={404: {"model": ErrorBody, "description": "No such replica."},
                           409: {"model": ErrorBody,
                                 "description": "A file or DNS source still lists it."}})
    async def remove_replica(replica_id: str) -> Removal:
        """Drain a replica and remove it (in-flight requests finish first)."""
        rid = ReplicaId(replica_id)
        if rid not in replicas:
            raise AdminError(404, f"no replica {replica_id!r}", "replica_not_found")
        membership.remove("admin", rid)
        membership.remove("static", rid)
        left = membership.sources(rid)
        if left:
            raise AdminError(409, f"replica {replica_id!r} is listed by {', '.join(left)}; "
                             "remove it there", "replica_managed_elsewhere")
        return Removal(id=rid, drain_timeout_s=settings.membership.drain_timeout_s)

    @app.post("/debug/route", tags=["debug"], openapi_extra=_DEBUG_BODY)
    async def route(request: Request,
                    endpoint: Literal["chat", "completions"] | None = None) -> Response:
        """The routing decision for a chat or completions body, without forwarding it
        (the proxy's policy and session headers apply)."""
        return await debug_route(request)

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    async def metrics() -> Response:
        """The router's Prometheus metrics."""
        registry = state["metrics"].registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


_DEBUG_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {
            "type": "object", "description": "A chat or completions request body."}}},
    },
}
