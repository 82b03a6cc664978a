"""Router API keys and tenants: who is asking, and what the router does for them.

With keys configured (``AuthSettings.keys``), every ``/v1/*`` request must carry
``Authorization: Bearer <key>``; the key's SHA-256 (the only form the configuration
holds) names its tenant.  A missing or unknown key is a 401 (OpenAI-shaped, with
``WWW-Authenticate: Bearer``).  Without keys, ``Access`` is not built and the router
behaves as if this module did not exist.

What a tenant gets:

- **Its own cache namespace.**  The router sets ``cache_salt`` on every JSON request body
  of the tenant (chat, completions, and any other ``/v1/*`` body that is a JSON object)
  to the tenant's salt (``TenantSettings.cache_salt``, default its name).  A salt the
  client sent is not refused: it becomes a sub-namespace, ``<tenant salt>.<32 hex digits
  of SHA-256(tenant salt NUL client salt)>``, so a client may partition its tenant's
  cache further but can never name another tenant's salt (tenant salts hold no ``.``).
  Tenants share cache blocks only when configured with the same salt.  The parsed body
  the policy sees carries the forwarded salt, so the ``kv`` policy predicts with the
  salt the replica hashes (predictions stay exact).
- **Its own sessions**: session keys (header or ``user``) are qualified by the tenant's
  name, so tenants never share session state.
- **Routing headers only if trusted** (``routing_headers``, default ``trusted``): the
  ``x-kvroute-*`` response headers say whether a prompt was cached (an oracle on what
  others sent).
- **Limits** (``router.tenant_limits``): concurrency and a token-bucket request rate,
  429 with ``Retry-After`` past either.

``check_endpoint`` applies ``AuthSettings.debug_route`` / ``metrics`` to those endpoints
of the main listener.  Keys are never logged or used as metric labels; tenant names
(from the configuration only) are.  Key lookups compare digests in a dict: the client
controls the key, not its digest, so the lookup's timing says nothing useful.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from router.config import AccessMode, AuthSettings
from router.errors import Forbidden, NotFound, Unauthorized
from router.metrics import TenantMetrics
from router.tenant_limits import TenantGate

__all__ = ["Access", "Tenant", "bearer_token", "check_endpoint", "namespaced_salt"]

_SUB_SALT_HEX = 32


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant as the request path uses it (copied from ``TenantSettings``)."""

    name: str
    cache_salt: str
    trusted: bool
    routing_headers: bool
    max_concurrency: int
    requests_per_s: float
    burst: int

    def apply_salt(self, body: MutableMapping[str, Any], raw: bytes) -> bytes:
        """Set the tenant's ``cache_salt`` in the parsed ``body`` (the client's salt, if
        any, already validated, becomes a sub-namespace); ``raw`` (the bytes ``body`` was
        parsed from) with the same change, to forward."""
        client = body.get("cache_salt")
        salt = namespaced_salt(self.cache_salt, client if isinstance(client, str) else None)
        had_fields = bool(body)
        body["cache_salt"] = salt
        if client is not None or not had_fields:
            return orjson.dumps(body)
        # No salt yet: splice it in after the object's opening brace (no re-encoding).
        start = raw.index(b"{") + 1
        return raw[:start] + b'"cache_salt":' + orjson.dumps(salt) + b"," + raw[start:]

    def session(self, session: str) -> str:
        """A session key qualified by the tenant: two tenants' session ``"1"`` are two
        sessions (stickiness, prefix-break history)."""
        return f"{self.name}:{session}"

    def scope(self, body: MutableMapping[str, Any] | None, raw: bytes,
              session: str | None) -> tuple[bytes, str | None]:
        """A request's body and session key as this tenant's: ``apply_salt`` (JSON
        object bodies only) and ``session``."""
        if body is not None:
            raw = self.apply_salt(body, raw)
        return raw, (self.session(session) if session is not None else None)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def namespaced_salt(tenant_salt: str, client_salt: str | None) -> str:
    """The ``cache_salt`` forwarded for a tenant, given what the client sent."""
    if client_salt is None:
        return tenant_salt
    digest = hashlib.sha256(f"{tenant_salt}\x00{client_salt}".encode()).hexdigest()
    return f"{tenant_salt}.{digest[:_SUB_SALT_HEX]}"


class Access:
    """Key -> tenant, salts, limits; built once in the lifespan when keys are configured."""

    def __init__(self, settings: AuthSettings, *, metrics: TenantMetrics,
                 clock: Callable[[], float]) -> None:
        tenants = {
            t.name: Tenant(
                name=t.name,
                cache_salt=t.cache_salt if t.cache_salt is not None else t.name,
                trusted=t.trusted,
                routing_headers=t.trusted if t.routing_headers is None else t.routing_headers,
                max_concurrency=t.max_concurrency,
                requests_per_s=t.requests_per_s,
                burst=t.burst,
            )
            for t in settings.tenants
        }
        self.tenants = tenants
        """By name."""
        self._by_digest = {k.sha256: tenants[k.tenant] for k in settings.keys}
        self._metrics = metrics
        self.gate = TenantGate(list(tenants.values()), metrics=metrics, clock=clock)
        """Per-tenant concurrency and rate limits."""

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of the request's ``Authorization`` value, or ``Unauthorized``."""
        token = bearer_token(authorization)
        if token is None:
            self._metrics.auth_failures.labels("missing_key").inc()
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        tenant = self._by_digest.get(hashlib.sha256(token.encode()).hexdigest())
        if tenant is None:
            self._metrics.auth_failures.labels("invalid_key").inc()
            raise Unauthorized("Incorrect API key provided.")
        return tenant

    def authenticate_trusted(self, authorization: str | None) -> Tenant:
        """As ``authenticate``, and ``Forbidden`` unless the tenant is trusted."""
        tenant = self.authenticate(authorization)
        if not tenant.trusted:
            self._metrics.auth_failures.labels("forbidden").inc()
            raise Forbidden(f"tenant {tenant.name!r} may not use this endpoint")
        return tenant

    def admit(self, authorization: str | None) -> Tenant:
        """Authenticate, then take a slot under the tenant's limits (``Unauthorized``,
        ``RateLimited``); give it back with ``release``."""
        tenant = self.authenticate(authorization)
        self.gate.admit(tenant)
        return tenant

    def release(self, tenant: Tenant) -> None:
        """Give back the slot ``admit`` took."""
        self.gate.release(tenant)


def check_endpoint(mode: AccessMode, access: Access | None,
                   authorization: str | None) -> Tenant | None:
    """Apply an endpoint's access mode: raises ``NotFound`` (disabled), ``Unauthorized``
    or ``Forbidden`` (trusted-only with keys configured); the caller's tenant, if known."""
    if mode == "disabled":
        raise NotFound("Not Found")
    if access is None:
        return None
    if mode == "open":
        try:
            return access.authenticate(authorization) if authorization else None
        except Unauthorized:
            return None
    return access.authenticate_trusted(authorization)
