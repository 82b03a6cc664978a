"""The admin API on its own listener (FastAPI): replicas added and removed at run time,
the debug route and metrics, OpenAPI, and the admin key (configured as its SHA-256)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry

from router.app import create_app
from router.config import ConfigError, RouterSettings
from tests.ports import free_port
from tests.router.fake_replica import FakeReplica
from tests.router.helpers import FAST_HEALTH, chat
from tests.router.server import run_server
from tests.router.test_membership import eventually

KEY = "correct horse battery staple"


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def _router(stack: AsyncExitStack, replicas: list[FakeReplica], **settings: Any
                  ) -> tuple[str, str, aiohttp.ClientSession]:  # fmt: skip
    port = free_port()
    data: dict[str, Any] = {
        "replicas": [{"url": r.url, "id": r.name} for r in replicas],
        "health": dict(FAST_HEALTH), "policy": "round_robin",
        "membership": {"drain_timeout_s": 5},
        **settings,
    }
    data["admin"] = {"enabled": True, "port": port, **settings.get("admin", {})}
    app = create_app(RouterSettings.model_validate(data), registry=CollectorRegistry(),
                     sighup=False)
    url = await stack.enter_async_context(run_server(app))
    http = await stack.enter_async_context(
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
    return url, f"http://127.0.0.1:{port}", http


async def call(http: aiohttp.ClientSession, method: str, url: str, *, key: str | None = None,
               **kw: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with http.request(method, url, headers=headers, **kw) as resp:
        body = await resp.read()
        ctype = resp.headers.get("content-type", "")
        return resp.status, (await resp.json()) if "json" in ctype and body else body


async def members(http: aiohttp.ClientSession, admin: str, key: str | None = None
                  ) -> dict[str, dict[str, Any]]:  # fmt: skip
    status, body = await call(http, "GET", admin + "/admin/replicas", key=key)
    assert status == 200, body
    return {r["id"]: r for r in body["replicas"]}


async def test_replicas_added_and_removed_through_the_admin_api(stack: AsyncExitStack) -> None:
    r0, r1 = [await stack.enter_async_context(FakeReplica(f"r{i}")) for i in range(2)]
    url, admin, http = await _router(stack, [r0])
    await eventually(lambda: _state(http, admin, "r0", "healthy"))
    assert (await members(http, admin))["r0"]["sources"] == ["static"]

    status, body = await call(http, "POST", admin + "/admin/replicas",
                              json={"url": r1.url, "id": "r1"})
    assert status == 201 and body["id"] == "r1" and body["sources"] == ["admin"]
    assert body["state"] == "unhealthy"  # no traffic before its first good probe
    await eventually(lambda: _state(http, admin, "r1", "healthy"))
    served = set()
    for _ in range(4):
        async with http.post(url + "/v1/chat/completions", json=chat()) as resp:
            assert resp.status == 200
            served.add(resp.headers["x-kvroute-replica"])
    assert served == {"r0", "r1"}
    status, _ = await call(http, "POST", admin + "/admin/replicas",
                           json={"url": r1.url, "id": "r1"})
    assert status == 200  # already a member
    status, body = await call(http, "POST", admin + "/admin/replicas",
                              json={"url": "http://127.0.0.1:1", "id": "r1"})
    assert status == 409 and body["error"]["code"] == "replica_conflict"
    status, body = await call(http, "POST", admin + "/admin/replicas", json={"url": "ftp://x"})
    assert status == 422 and body["error"]["type"] == "invalid_request_error"
    assert "url" in body["error"]["message"]

    status, body = await call(http, "DELETE", admin + "/admin/replicas/r0")
    assert status == 202 and body == {"id": "r0", "state": "draining", "drain_timeout_s": 5.0}
    await eventually(lambda: _gone(http, admin, "r0"))
    async with http.post(url + "/v1/chat/completions", json=chat()) as resp:
        assert resp.headers["x-kvroute-replica"] == "r1"
    status, body = await call(http, "DELETE", admin + "/admin/replicas/r0")
    assert status == 404 and body["error"]["code"] == "replica_not_found"

    # the debug route and the metrics are on the admin listener too
    status, body = await call(http, "POST", admin + "/debug/route", json=chat())
    assert status == 200 and body["replicas"] == ["r1"]
    status, text = await call(http, "GET", admin + "/metrics")
    assert status == 200 and b'router_membership_changes_total{change="added",source="admin"}' \
        b" 1.0" in text
    # the OpenAPI description, and nothing of it on the proxy's listener
    status, spec = await call(http, "GET", admin + "/openapi.json")
    assert status == 200 and {"/admin/replicas", "/admin/replicas/{replica_id}",
                              "/debug/route", "/metrics"} <= set(spec["paths"])
    status, page = await call(http, "GET", admin + "/docs")
    assert status == 200 and b"swagger" in page.lower()
    status, _ = await call(http, "GET", url + "/admin/replicas")
    assert status == 404


async def test_a_replica_listed_by_the_file_is_not_removed_by_the_api(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    r0 = await stack.enter_async_context(FakeReplica("r0"))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"replicas": [{"url": r0.url, "id": "r0"}]}))
    _, admin, http = await _router(stack, [], membership={"file": str(fleet),
                                                          "file_poll_s": 3600})
    await eventually(lambda: _state(http, admin, "r0", "healthy"))
    status, body = await call(http, "DELETE", admin + "/admin/replicas/r0")
    assert status == 409 and body["error"]["code"] == "replica_managed_elsewhere"
    assert (await members(http, admin))["r0"]["state"] == "healthy"


async def test_the_admin_key_is_required_when_configured(stack: AsyncExitStack) -> None:
    r0 = await stack.enter_async_context(FakeReplica("r0"))
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    _, admin, http = await _router(stack, [r0], admin={"key_sha256": digest})
    for path, method in (("/admin/replicas", "GET"), ("/admin/replicas", "POST"),
                         ("/admin/replicas/r0", "DELETE"), ("/metrics", "GET"),
                         ("/debug/route", "POST")):
        for key in (None, "wrong", digest):  # the hash itself is not the key
            async with http.request(method, admin + path, json=chat(),
                                    headers={"Authorization": f"Bearer {key}"} if key else {}
                                    ) as resp:  # fmt: skip
                assert resp.status == 401, (path, key)
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                body = await resp.json()
                assert body["error"]["code"] == "invalid_api_key"
    assert set(await members(http, admin, KEY)) == {"r0"}
    status, _ = await call(http, "GET", admin + "/metrics", key=KEY)
    assert status == 200
    status, spec = await call(http, "GET", admin + "/openapi.json")  # the description is public
    assert status == 200 and "HTTPBearer" in spec["components"]["securitySchemes"]
    await asyncio.sleep(0)


def test_the_admin_key_is_configured_as_a_hash_never_in_plain() -> None:
    with pytest.raises(ConfigError, match="admin.key_sha256: .*SHA-256"):
        RouterSettings.load(env={}, cli={"replicas": [{"url": "http://127.0.0.1:1"}],
                                         "admin": {"key_sha256": KEY}})
    ok = RouterSettings.load(env={}, cli={"admin": {"enabled": True, "key_sha256":
                                                    hashlib.sha256(b"k").hexdigest().upper()}})
    assert ok.admin.key_sha256 == hashlib.sha256(b"k").hexdigest() and ok.replicas == []
    assert not RouterSettings.load(env={}, cli={"replicas": [{"url": "http://h:1"}]}
                                   ).admin.enabled  # off by default


async def _state(http: aiohttp.ClientSession, admin: str, rid: str, state: str) -> bool:
    found = (await members(http, admin)).get(rid)
    return found is not None and found["state"] == state


async def _gone(http: aiohttp.ClientSession, admin: str, rid: str) -> bool:
    return rid not in await members(http, admin)
