"""Settings of API keys and tenants (the ``auth`` section of ``RouterSettings``; see
``router.config`` and ``router.tenancy``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

__all__ = ["AccessMode", "ApiKeySettings", "AuthSettings", "TenantSettings"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


_TENANT_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_MAX_TENANT_SALT = 95  # 128 (vLLM's cap) minus '.' and 32 hex digits of a client's sub-salt
AccessMode = Literal["open", "trusted", "disabled"]
"""Who may use an endpoint on the main listener: anyone, trusted tenants only (when
keys are configured; anyone otherwise), or no one (404)."""


class TenantSettings(_Section):
    """One tenant: what its API keys may do."""

    name: str = Field(pattern=_TENANT_NAME)
    """The tenant's name (a metric label: letters, digits, ``_`` and ``-``)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=_MAX_TENANT_SALT)
    """The ``cache_salt`` the router sets on every request of this tenant (default: the
    tenant's name).  Tenants share cache blocks only when given the same salt."""
    trusted: bool = False
    """May use ``/debug/route`` (and ``/metrics``) when those are ``trusted``-only."""
    routing_headers: bool | None = None
    """Send the ``x-kvroute-*`` response headers (replica, reason, predicted cached
    tokens: a cache-hit oracle); ``None`` means only if ``trusted``."""
    max_concurrency: int = Field(default=0, ge=0)
    """Requests in flight at once (0: unlimited); more get 429."""
    requests_per_s: float = Field(default=0.0, ge=0)
    """Sustained request rate (token bucket; 0: unlimited); more get 429."""
    burst: int = Field(default=0, ge=0)
    """Bucket size: requests allowed at once after a quiet spell (0: ``requests_per_s``
    rounded up, at least 1)."""

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, value: str | None) -> str | None:
        if value is not None and any(c in "@/\\\x00." for c in value):
            raise ValueError("must not contain '@', '/', '\\', NUL or '.'")
        return value


class ApiKeySettings(_Section):
    """One router API key, stored only as its SHA-256 (``printf %s "$KEY" | sha256sum``)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Lower-case hex SHA-256 of the key (never the key itself)."""
    tenant: str
    """The tenant the key belongs to (a name under ``auth.tenants``)."""


class AuthSettings(_Section):
    """Router API keys (``Authorization: Bearer``) and tenants (``router.tenancy``).
    With no ``keys``, the router is open, as without this section."""

    keys: list[ApiKeySettings] = Field(default_factory=list)
    """Accepted keys (hashes); when any is set, every ``/v1/*`` request needs one (401)."""
    tenants: list[TenantSettings] = Field(default_factory=list)
    """Tenants the keys map to."""
    forward_authorization: bool | None = None
    """Pass the client's ``Authorization`` to the replicas; ``None``: only when no keys
    are configured (then it is the replicas' key, as without this section)."""
    upstream_key: SecretStr | None = None
    """Key sent to the replicas (``Authorization: Bearer``, vLLM ``--api-key``) when the
    client's is not forwarded, also by health probes and model discovery; set it from
    the environment (``KVROUTE_AUTH__UPSTREAM_KEY``), not the file."""
    debug_route: AccessMode = "trusted"
    """``POST /debug/route`` on the main listener."""
    metrics: AccessMode = "open"
    """``GET /metrics`` on the main listener (scrapers usually bring no key)."""

    @model_validator(mode="after")
    def _check_keys(self) -> AuthSettings:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenants: duplicate tenant name")
        hashes = [k.sha256 for k in self.keys]
        if len(set(hashes)) != len(hashes):
            raise ValueError("keys: duplicate key hash")
        for key in self.keys:
            if key.tenant not in names:
                raise ValueError(f"keys: unknown tenant {key.tenant!r}")
        return self

    @property
    def enabled(self) -> bool:
        """Keys are configured: requests must authenticate."""
        return bool(self.keys)

    @property
    def forwards_client_key(self) -> bool:
        """``forward_authorization`` resolved: by default, only when no keys are set."""
        if self.forward_authorization is None:
            return not self.keys
        return self.forward_authorization
