"""Finding a replica's KV event streams from its URL alone.

vLLM 0.31+ serves ``GET /kv_event_sources``: ``{dp_rank: KVEventsConfig}`` with each
engine core's *resolved* endpoints (``tcp://*:0`` already replaced by the bound port).
``discover_sources`` turns that into ``DiscoveredSource``s, one per DP rank with events
enabled:

* vLLM reports ``tcp://*:P`` unchanged, but a ``tcp://*:0`` endpoint as the bound
  ``tcp://<node ip>:<port>``, which looks exactly like an endpoint the engine *connects*
  to.  So every endpoint is taken as one the engine bound, which we **connect** to (the
  replica URL's host in place of a wildcard address), unless it is one of the
  ``bind_endpoints`` this router binds itself (``mode="bind"``: engines connect to us and
  the source is identified by its topic).  The replay endpoint is always bound by the
  engine and gets the same host treatment.
* If several ranks report the same endpoint (a config that was not resolved per rank),
  vLLM's port + rank rule is applied (``offset_endpoint_port``).
* Rank 0 is the replica itself; rank ``k > 0`` is ``replica_id_for_rank(replica, k)``.

Errors (network, non-200, bad JSON) raise ``DiscoveryError``; a 404 means the replica
predates 0.31 (or is not vLLM) and ``DiscoveryError.unsupported`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from index.subscriber import EventSource
from kvkeys.types import ReplicaId, replica_id_for_rank

__all__ = [
    "DiscoveredSource",
    "DiscoveryError",
    "discover_model",
    "discover_sources",
    "is_bind_endpoint",
    "offset_endpoint_port",
    "parse_event_sources",
    "resolve_endpoint",
]

log = logging.getLogger(__name__)


class DiscoveryError(Exception):
    """``/kv_event_sources`` could not be read."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


@dataclass(frozen=True, slots=True)
class DiscoveredSource:
    """One DP rank's event stream and how to receive it."""

    source: EventSource
    mode: Literal["connect", "bind"]
    bind_endpoint: str | None = None
    """For ``bind``: the address the engine connects to, which the router must bind."""
    dp_rank: int = 0


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: the engine binds wildcard and local-transport endpoints."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint_port(endpoint: str, dp_rank: int) -> str:
    """vLLM's per-rank endpoint: ``tcp://h:P`` -> ``tcp://h:(P+rank)``, ``inproc://x`` ->
    ``inproc://x_dp{rank}``; rank 0 and port 0 unchanged; ``ipc://`` with rank > 0 is an
    error."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("ipc://"):
        raise ValueError("ipc:// endpoints cannot be offset for data-parallel ranks")
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{head}:{int(port) + dp_rank}"
    return endpoint


def resolve_endpoint(endpoint: str, host: str) -> str:
    """Put ``host`` in place of a wildcard address in a ``tcp://`` endpoint."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    addr, _, port = endpoint[len("tcp://") :].rpartition(":")
    if addr in ("*", "0.0.0.0", "::", "[::]", "[*]", ""):
        h = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{h}:{port}"
    return endpoint


def parse_event_sources(
    body: Any,
    replica_url: str,
    replica: ReplicaId,
    model: str,
    *,
    bind_endpoints: Collection[str] = (),
) -> list[DiscoveredSource]:
    """Interpret a ``/kv_event_sources`` body (see the module docstring)."""
    if not isinstance(body, dict):
        raise DiscoveryError("kv_event_sources is not a JSON object")
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    ranks: list[tuple[int, dict[str, Any]]] = []
    for key, cfg in body.items():
        try:
            rank = int(key)
        except (TypeError, ValueError) as exc:
            raise DiscoveryError(f"bad DP rank {key!r}") from exc
        if not isinstance(cfg, dict):
            raise DiscoveryError(f"rank {rank}: config is not an object")
        ranks.append((rank, cfg))
    ranks.sort(key=lambda rc: rc[0])
    seen: dict[str, int] = {}
    out: list[DiscoveredSource] = []
    for rank, cfg in ranks:
        if not cfg.get("enable_kv_cache_events", False) or cfg.get("publisher") == "null":
            continue
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise DiscoveryError(f"rank {rank}: no endpoint")
        replay = cfg.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise DiscoveryError(f"rank {rank}: bad replay_endpoint")
        if endpoint in seen and rank > 0:
            endpoint = offset_endpoint_port(endpoint, rank)
            if replay:
                replay = offset_endpoint_port(replay, rank)
        seen.setdefault(cfg["endpoint"], rank)
        topic = cfg.get("topic") or ""
        rid = replica_id_for_rank(replica, rank)
        replay_ep = resolve_endpoint(replay, host) if replay else None
        if endpoint not in bind_endpoints:
            ep = resolve_endpoint(endpoint, host)
            if ep.endswith(":0"):
                raise DiscoveryError(f"rank {rank}: endpoint {endpoint} has no port")
            out.append(
                DiscoveredSource(
                    EventSource(rid, model, ep, replay_ep, topic), "connect", dp_rank=rank
                )  # fmt: skip
            )
        else:
            out.append(
                DiscoveredSource(
                    EventSource(rid, model, None, replay_ep, topic), "bind", endpoint, rank
                )
            )
    return out


async def discover_sources(
    session: aiohttp.ClientSession,
    replica_url: str,
    replica: ReplicaId,
    model: str,
    *,
    timeout_s: float = 2.0,
    bind_endpoints: Collection[str] = (),
) -> list[DiscoveredSource]:
    """Read ``{replica_url}/kv_event_sources`` and interpret it."""
    url = replica_url.rstrip("/") + "/kv_event_sources"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 404:
                raise DiscoveryError(f"{url}: 404 (vLLM < 0.31?)", unsupported=True)
            if resp.status != 200:
                raise DiscoveryError(f"{url}: HTTP {resp.status}")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise DiscoveryError(f"{url}: {exc}") from exc
    return parse_event_sources(body, replica_url, replica, model, bind_endpoints=bind_endpoints)


async def discover_model(
    session: aiohttp.ClientSession, replica_url: str, *, timeout_s: float = 2.0
) -> str:
    """The base model a replica serves: the first ``/v1/models`` entry that is not a
    LoRA adapter (adapters carry a ``parent``)."""
    url = replica_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise DiscoveryError(f"{url}: HTTP {resp.status}")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise DiscoveryError(f"{url}: {exc}") from exc
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list):
        for card in data:
            if not isinstance(card, dict) or card.get("parent"):
                continue
            model = card.get("id")
            if isinstance(model, str):
                return model
    raise DiscoveryError(f"{url}: no base model listed")
