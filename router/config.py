"""The router's configuration: one frozen, typed settings object, parsed once at start-up.

Sources, lowest priority first: field defaults, the YAML file (``--config``), environment
variables (``KVROUTE_`` prefix, ``__`` between nested names, e.g.
``KVROUTE_TIMEOUTS__CONNECT_S=2``; lists such as ``KVROUTE_REPLICAS`` are JSON), then
command-line flags.  ``RouterSettings.load`` merges them and validates the result; a bad
value raises ``ConfigError`` whose message names the field (dotted path) and the source it
came from.

Contract: nothing else in ``router`` reads ``os.environ``; ``create_app`` hands each
component its own section.  The settings are never read on the hot path through pydantic:
components copy the numbers they need at construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    SettingsConfigDict,
)

from router.config_auth import AccessMode, ApiKeySettings, AuthSettings, TenantSettings
from router.config_membership import AdminSettings, DnsSourceSettings, MembershipSettings
from router.config_scoring import (
    ModelSettings,
    PromptMemorySettings,
    RenderWorkerSettings,
    ScoringSettings,
    ScrapeSettings,
)

__all__ = [
    "AccessMode",
    "ApiKeySettings",
    "AuthSettings",
    "ConfigError",
    "ConnectionSettings",
    "FailoverSettings",
    "HealthSettings",
    "IndexSettings",
    "MemoryIndexSettings",
    "ModelSettings",
    "PromptMemorySettings",
    "RedisIndexSettings",
    "RenderWorkerSettings",
    "ReplicaSettings",
    "RouterSettings",
    "ScoringSettings",
    "ScrapeSettings",
    "TenantSettings",
    "TimeoutSettings",
    "UpstreamSettings",
    "MembershipSettings",
    "DnsSourceSettings",
    "AdminSettings",
]


class ConfigError(ValueError):
    """The configuration is invalid; the message names each bad field and its source."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ReplicaSettings(_Section):
    """One upstream OpenAI-compatible server (a vLLM replica)."""

    url: str
    """Base URL of the replica, e.g. ``http://127.0.0.1:8000`` (no path)."""
    id: str = ""
    """The router's name for the replica; defaults to ``host:port`` of ``url``."""
    kv_events_endpoint: str | None = None
    """ZMQ endpoint of the replica's KV-event publisher (``tcp://host:5557``), if any."""
    replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint that replays missed KV-event batches, if any."""
    models: list[str] | None = None
    """Models served; ``None`` means discover them from the replica's ``/v1/models``."""

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, data: Any) -> Any:
        """A bare URL string stands for ``{url: URL}``."""
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"must be a base URL without path or query, got {value!r}")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise ValueError(f"has an invalid port: {value!r}") from exc
        return value.rstrip("/")

    @model_validator(mode="after")
    def _default_id(self) -> ReplicaSettings:
        if not self.id:
            parts = urlsplit(self.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            object.__setattr__(self, "id", f"{parts.hostname}:{port}")
        return self


class TimeoutSettings(_Section):
    """Every network wait of the router, in seconds (all must be > 0)."""

    connect_s: float = Field(default=3.0, gt=0)
    """TCP connect to a replica; a replica that does not accept within this is skipped."""
    stream_read_s: float = Field(default=300.0, gt=0)
    """Streaming: the longest gap between two chunks, including the wait for the first
    (a queued prompt can wait long for its first token under load)."""
    non_stream_read_s: float = Field(default=900.0, gt=0)
    """Non-streaming: vLLM sends nothing until the whole generation is done."""
    health_probe_s: float = Field(default=1.0, gt=0)
    """One ``GET /health`` or ``GET /v1/models`` probe."""
    shutdown_grace_s: float = Field(default=30.0, gt=0)
    """On SIGTERM, how long in-flight requests may finish before they are cancelled."""


class HealthSettings(_Section):
    """Active health checking: ``GET /health`` per replica, with hysteresis."""

    interval_s: float = Field(default=2.0, gt=0)
    """Time between two probe rounds."""
    fails_to_down: int = Field(default=2, ge=1)
    """Consecutive failures that mark a healthy replica down."""
    successes_to_up: int = Field(default=2, ge=1)
    """Consecutive successes that mark a down replica up again."""
    models_refresh_s: float = Field(default=30.0, gt=0)
    """How often each healthy replica's ``/v1/models`` is re-read (also on every recovery)."""
    passive_failures: bool = True
    """Count connect errors of proxied requests as failed probes (faster mark-down)."""


class ReadinessSettings(_Section):
    """What ``GET /ready`` requires besides a healthy replica (``router.readiness``)."""

    require_kv_events: bool = False
    """Answer 503 while KV event ingestion is down (a source's subscriber or the
    ingestion task failed recently).  Off by default: the router still routes, by
    affinity, and every router of a fleet would go out of service at once."""


class FailoverSettings(_Section):
    """Retrying on another replica before the first byte reaches the client."""

    max_attempts: int = Field(default=2, ge=1)
    """Upstream attempts per request in total (1 = no failover)."""
    backoff_base_s: float = Field(default=0.005, ge=0)
    """Sleep before the 2nd attempt; doubled for each later one."""
    backoff_cap_s: float = Field(default=0.1, ge=0)
    """Upper bound of one backoff sleep."""


class UpstreamSettings(_Section):
    """The shared upstream HTTP client."""

    max_connections: int = Field(default=0, ge=0)
    """Pooled connections to all replicas together; 0 means unlimited."""
    keepalive_s: float = Field(default=60.0, gt=0)
    """How long an idle upstream connection is kept for reuse."""


class MemoryIndexSettings(_Section):
    """The in-process KV index (one router replica)."""

    backend: Literal["memory"] = "memory"
    """Discriminator."""


class RedisIndexSettings(_Section):
    """A KV index shared by several routers in Redis."""

    backend: Literal["redis"] = "redis"
    """Discriminator."""
    url: str = "redis://127.0.0.1:6379/0"
    """Redis URL."""
    key_prefix: str = "kvroute:"
    """Prefix of every key the index writes."""
    op_timeout_s: float = Field(default=0.05, gt=0)
    """One Redis operation; on timeout the router falls back to affinity."""
    share_outlook: bool = True
    """Share the ``kv`` policy's look ahead with the other routers on this index, over
    the Redis channel ``<key_prefix>:outlook`` (``router.outlook_peers``): the requests
    each routes and that finish, so each forecasts pool space and evictions from the
    whole fleet's requests."""
    outlook_timeout_s: float = Field(default=1.0, gt=0)
    """One Redis call of the look-ahead channel (publish, subscribe, connect)."""


IndexSettings = Annotated[MemoryIndexSettings | RedisIndexSettings, Field(discriminator="backend")]
"""Which KV index backend the router uses (``backend: memory | redis``)."""


class ConnectionSettings(_Section):
    """Client connections to the router: slow or idle clients are cut off, and the number
    of open connections and the size of request headers are bounded (``router.conn_guard``)."""

    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must all arrive within this time of its first byte
    (a client that stalls mid-headers gets 408 and is closed)."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """A request's whole body must arrive within this time of its headers (an 8 MiB body
    in 60 s is 140 KB/s); a client that stalls mid-body is closed."""
    idle_timeout_s: float = Field(default=5.0, gt=0)
    """A connection with no request in progress (before the first one or between two)
    is closed after this time (uvicorn's keep-alive default; keep it above the idle
    timeout of a load balancer in front, e.g. 65 behind a 60 s one)."""
    max_connections: int = Field(default=4096, ge=1)
    """Open client connections; a connection past this is closed at once (raise the fd
    limit, ``ulimit -n``, above it)."""
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    """Bytes of the request line and headers together; more gets 431 (nginx and Node
    allow 8-32 KiB)."""
    max_headers: int = Field(default=100, ge=1)
    """Request header fields; more gets 431 (Apache's ``LimitRequestFields``)."""


class RouterSettings(BaseSettings):
    """Everything ``kvroute serve`` needs, validated once."""

    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    host: str = "127.0.0.1"
    """Address the router listens on."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port the router listens on (0 picks a free port)."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """Log level of the router and uvicorn."""
    access_log: bool = False
    """uvicorn access log (off: one log line per request costs throughput)."""
    replicas: list[ReplicaSettings] = Field(default_factory=list)
    """The upstream replicas (at least one)."""
    policy: str = "kv"
    """Default routing policy (a name in the policy registry)."""
    policy_header: str = "X-KVRoute-Policy"
    """Request header that selects another registered policy for one request."""
    session_header: str = "X-Session-ID"
    """Request header carrying the session key (else the body's ``user``)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    """Largest accepted request body; larger bodies get 413.  8 MiB fits a 128k-token
    chat with room to spare."""
    seed: int | None = None
    """Seed of the ``random`` policy's generator (``None``: from the OS)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Wall seconds per second of the router's judgement clock: leave at 1 in front of
    real engines.  Simulated replicas that run faster than real time (``kvroute sim
    --time-scale 0.1``) need the same value here, so that what the policy learns in
    seconds (think and service times, TTFTs, allocation rates, the scrape interval,
    provisional and placement windows) is in the replicas' time, like the configured
    prefill rate it is weighed against; network timeouts and health probes stay in
    wall seconds."""
    clock_file: Path | None = None
    """Benchmarks only: a shared clock offset file (``aio.clock_warp``) that a benchmark
    moves forward while its simulated fleet is idle, skipping the wait for the trace's
    next turn; the judgement clock (``time_scale``) moves with it, as the replicas'
    clocks do.  ``None`` (the default) in front of real engines."""
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    """Network timeouts."""
    health: HealthSettings = Field(default_factory=HealthSettings)
    """Health checking."""
    readiness: ReadinessSettings = Field(default_factory=ReadinessSettings)
    """What ``/ready`` requires."""
    failover: FailoverSettings = Field(default_factory=FailoverSettings)
    """Failover before the first byte."""
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    """Shared upstream HTTP client."""
    index: IndexSettings = Field(default_factory=MemoryIndexSettings)
    """KV index backend."""
    scoring: ScoringSettings = Field(default_factory=ScoringSettings)
    """KV-aware scoring knobs."""
    connections: ConnectionSettings = Field(default_factory=ConnectionSettings)
    """Client connection limits and timeouts."""
    auth: AuthSettings = Field(default_factory=AuthSettings)
    """API keys, tenants, and who may use the debug and metrics endpoints."""
    membership: MembershipSettings = Field(default_factory=MembershipSettings)
    """Run-time replica sources (file, DNS) and draining."""
    admin: AdminSettings = Field(default_factory=AdminSettings)
    """The admin listener."""

    @field_validator("policy_header", "session_header")
    @classmethod
    def _check_header(cls, value: str) -> str:
        if not value or any(c.isspace() or c == ":" for c in value):
            raise ValueError(f"must be a valid HTTP header name, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_replicas(self) -> RouterSettings:
        dynamic = self.membership.file or self.membership.dns or self.admin.enabled
        if not self.replicas and not dynamic:
            raise ValueError(
                "replicas: at least one replica is required "
                "(--replica URL, KVROUTE_REPLICAS or 'replicas:' in the config file), "
                "or a run-time source (membership.file, membership.dns, admin.enabled)"
            )
        seen: set[str] = set()
        for replica in self.replicas:
            if replica.id in seen:
                raise ValueError(f"replicas: duplicate replica id {replica.id!r}")
            seen.add(replica.id)
        return self

    @classmethod
    def load(
        cls,
        *,
        config_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cli: Mapping[str, Any] | None = None,
    ) -> RouterSettings:
        """Merge YAML < environment < CLI flags and validate.

        ``env`` defaults to ``os.environ``; ``cli`` holds already-named fields (flags that
        were not given must be absent).  Raises ``ConfigError``.
        """
        sources: list[tuple[str, dict[str, Any]]] = []
        if config_file is not None:
            sources.append((f"config file {config_file}", _read_yaml(Path(config_file))))
        sources.append(("environment (KVROUTE_*)", _read_env(cls, env)))
        if cli:
            sources.append(("command line", dict(cli)))
        merged: dict[str, Any] = {}
        for _, data in sources:
            merged = _deep_merge(merged, data)
        try:
            # Only the merged dict: the environment was read above (or injected).
            only = InitSettingsSource(cls, init_kwargs=merged)
            return cls(_build_sources=((only,), {}))  # type: ignore[call-arg]
        except ValidationError as exc:
            raise ConfigError(_describe(exc, sources)) from exc


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: invalid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of settings")
    return data


def _read_env(cls: type[BaseSettings], env: Mapping[str, str] | None) -> dict[str, Any]:
    source = EnvSettingsSource(
        cls, case_sensitive=False, env_prefix="KVROUTE_", env_nested_delimiter="__"
    )
    if env is not None:
        source.env_vars = {k.lower(): v for k, v in env.items()}
    try:
        return dict(source())
    except Exception as exc:  # pydantic-settings raises SettingsError on bad JSON
        raise ConfigError(_env_error(str(exc))) from exc


_ENV_EXAMPLES = {
    "replicas": """'["http://127.0.0.1:8001", {"url": "http://127.0.0.1:8002"}]'""",
    "index": """'{"backend": "redis", "url": "redis://127.0.0.1:6379/0"}'""",
}


def _env_error(message: str) -> str:
    """A readable message for an environment value pydantic-settings could not parse (a
    list or mapping that is not JSON)."""
    import re

    found = re.search(r'field "(\w+)"', message)
    if found is None:
        return f"environment (KVROUTE_*): {message}"
    name = found.group(1)
    example = _ENV_EXAMPLES.get(name, "'[...]' or '{...}'")
    return (f"environment: KVROUTE_{name.upper()} is not valid JSON; list and mapping "
            f"values in the environment are JSON, e.g. KVROUTE_{name.upper()}={example}")


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _origin(loc: tuple[int | str, ...], sources: list[tuple[str, dict[str, Any]]]) -> str | None:
    found = None
    for name, data in sources:
        node: Any = data
        ok = True
        for part in loc:
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                ok = False
                break
        if ok and loc:
            found = name
    return found


def _describe(exc: ValidationError, sources: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["invalid kvroute configuration:"]
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in ("memory", "redis")))
        field = ".".join(str(p) for p in loc) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if loc[:1] == ("replicas",) and len(loc) == 2 and err["type"] == "model_type":
            msg = (f"each replica is a URL or a mapping with at least 'url:' (e.g. "
                   f"'- url: http://127.0.0.1:8001'), got {err['input']!r}")
        origin = _origin(loc, sources)
        lines.append(f"  {field}: {msg}" + (f" (from {origin})" if origin else ""))
    return "\n".join(lines)

