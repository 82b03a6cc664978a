"""Settings of the run-time membership and of the admin listener (sections of
``RouterSettings``: ``membership`` and ``admin``; see ``router.config``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["AdminSettings", "DnsSourceSettings", "MembershipSettings"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class DnsSourceSettings(_Section):
    """Replicas behind one DNS name (a Kubernetes headless Service): every address the
    name resolves to is a replica ``scheme://address:port``, re-resolved every
    ``interval_s``."""

    name: str
    """The DNS name, e.g. ``vllm.default.svc.cluster.local``."""
    port: int = Field(default=8000, ge=1, le=65535)
    """The replicas' HTTP port."""
    scheme: Literal["http", "https"] = "http"
    """The replicas' URL scheme."""
    interval_s: float = Field(default=10.0, gt=0)
    """Time between two resolutions."""
    timeout_s: float = Field(default=2.0, gt=0)
    """One resolution; a failed or empty answer keeps the last known addresses."""


class MembershipSettings(_Section):
    """Replicas that join and leave at run time (``router.membership``)."""

    file: str | None = None
    """A YAML file with a ``replicas:`` list (same shape as the setting), re-read on
    SIGHUP and when its modification time changes."""
    file_poll_s: float = Field(default=2.0, gt=0)
    """How often the file's modification time is checked."""
    dns: list[DnsSourceSettings] = Field(default_factory=list)
    """DNS names whose addresses are replicas."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """A leaving replica gets no new requests; its in-flight ones get this long to finish
    before its index entries, event subscribers and metrics series are dropped."""


class AdminSettings(_Section):
    """The admin listener (FastAPI, OpenAPI at ``/docs``): ``/admin/replicas``,
    ``/debug/route`` and ``/metrics``, on its own host and port."""

    enabled: bool = False
    """Serve the admin API at all."""
    host: str = "127.0.0.1"
    """Address of the admin listener (loopback by default)."""
    port: int = Field(default=8081, ge=0, le=65535)
    """Port of the admin listener (0 picks a free one); with ``--workers N`` worker i
    listens on ``port + i``."""
    key_sha256: str | None = None
    """Hex SHA-256 of the admin key (``printf %s KEY | sha256sum``); when set, every admin
    request needs ``Authorization: Bearer KEY``.  The key itself is never configured."""

    @field_validator("key_sha256")
    @classmethod
    def _check_hash(cls, value: str | None) -> str | None:
        if value is None:
            return None
        v = value.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be the 64 hex digits of a SHA-256 hash, not the key itself")
        return v

