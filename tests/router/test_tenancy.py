"""API keys, tenants, the cache-hit oracle and per-tenant limits (``router.tenancy``,
``router.tenant_limits``), through the real router under uvicorn and fake replicas on
loopback."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from kvkeys.types import ReplicaId
from router.app import create_app
from router.config import AuthSettings, ConfigError, RouterSettings
from router.metrics import TenantMetrics
from router.policy import Decision, Receipt, RouteRequest
from router.request import session_key
from router.tenancy import Access, bearer_token, namespaced_salt
from router.tenant_limits import TokenBucket
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat, scrape

KEYS = {"acme": "sk-acme-3f9a1c", "beta": "sk-beta-77d2e0", "slow": "sk-slow-0b41aa",
        "narrow": "sk-narrow-c0ffee"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def auth(**overrides: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "keys": [{"sha256": sha(k), "tenant": t} for t, k in KEYS.items()],
        "tenants": [
            {"name": "acme"},
            {"name": "beta", "trusted": True, "cache_salt": "beta-salt"},
            {"name": "slow", "requests_per_s": 0.01, "burst": 2},
            {"name": "narrow", "max_concurrency": 2},
        ],
    }
    section.update(overrides)
    return section


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def post(client: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None,
               **body: Any) -> tuple[int, dict[str, str], Any]:
    async with client.post(url + "/v1/chat/completions", json=chat(**body),
                           headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


# ---------------------------------------------------------------- keys


async def test_without_keys_the_router_is_open_as_before(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake])
    status, headers, _ = await post(client, url, {"Authorization": "Bearer replica-key"})
    assert status == 200
    assert "x-kvroute-replica" in {h.lower() for h in headers}
    seen = fake.completions()[0]
    assert seen.headers["Authorization"] == "Bearer replica-key"
    assert "cache_salt" not in orjson.loads(seen.body)
    async with client.post(url + "/debug/route", json=chat()) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("value", [None, "Bearer sk-wrong", "Basic " + KEYS["acme"],
                                   "Bearer", KEYS["acme"]])
async def test_missing_or_wrong_key_is_401(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession,
        value: str | None) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth())
    headers = {} if value is None else {"Authorization": value}
    for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models"), ("POST", "/v1/embeddings")]:
        async with client.request(method, url + path, json=chat(), headers=headers) as resp:
            assert resp.status == 401, path
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            error = (await resp.json())["error"]
            assert error["code"] == "invalid_api_key" and error["type"]
            assert KEYS["acme"] not in error["message"]
    assert fake.completions() == []
    for path in ("/health", "/ready"):
        async with client.get(url + path) as resp:
            assert resp.status == 200
    metrics = await scrape(client, url)
    reason = "missing_key" if bearer_token(value) is None else "invalid_key"
    assert metrics[("router_auth_failures_total", (("reason", reason),))] == 4


async def test_a_valid_key_is_served_and_not_forwarded(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth())
    status, _, _ = await post(client, url, bearer("acme"))
    assert status == 200
    assert "Authorization" not in fake.completions()[0].headers
    async with client.get(url + "/v1/models", headers=bearer("acme")) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "m"
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    assert KEYS["acme"] not in text and sha(KEYS["acme"]) not in text


async def test_upstream_key_replaces_the_clients_and_reaches_probes(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth(upstream_key="replica-secret"))
    await post(client, url, bearer("acme"))
    assert fake.completions()[0].headers["Authorization"] == "Bearer replica-secret"
    assert fake.probe_authorization
    assert set(fake.probe_authorization) == {"Bearer replica-secret"}


async def test_forward_authorization_passes_the_clients_key(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth(forward_authorization=True))
    await post(client, url, bearer("acme"))
    assert fake.completions()[0].headers["Authorization"] == f"Bearer {KEYS['acme']}"


@pytest.mark.parametrize(("section", "needle"), [
    ({"keys": [{"sha256": "sk-plain-key", "tenant": "a"}], "tenants": [{"name": "a"}]},
     "auth.keys.0.sha256"),
    ({"keys": [{"sha256": sha("k"), "tenant": "nobody"}], "tenants": [{"name": "a"}]},
     "unknown tenant"),
    ({"tenants": [{"name": "a b"}]}, "auth.tenants.0.name"),
    ({"tenants": [{"name": "a", "cache_salt": "x.y"}]}, "auth.tenants.0.cache_salt"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]}, "duplicate tenant"),
])
def test_config_holds_hashes_and_checked_tenants(section: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        RouterSettings.load(env={}, cli={"replicas": [{"url": "http://127.0.0.1:1"}],
                                         "auth": section})
    assert needle in str(exc.value)


def test_the_upstream_key_never_shows_in_the_settings() -> None:
    settings = RouterSettings.load(
        env={"KVROUTE_AUTH__UPSTREAM_KEY": "replica-secret-9"},
        cli={"replicas": [{"url": "http://127.0.0.1:1"}]})
    assert settings.auth.upstream_key is not None
    assert settings.auth.upstream_key.get_secret_value() == "replica-secret-9"
    assert "replica-secret-9" not in repr(settings) + str(settings)
    assert "replica-secret-9" not in settings.model_dump_json()


# ---------------------------------------------------------------- cache salt


async def test_each_tenant_gets_its_own_cache_salt(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth())
    await post(client, url, bearer("acme"))
    await post(client, url, bearer("beta"))
    await post(client, url, bearer("acme"), cache_salt="mine")
    await post(client, url, bearer("beta"), cache_salt="mine")
    await post(client, url, bearer("beta"), cache_salt="beta-salt")
    async with client.post(url + "/v1/responses", json={"model": "m", "input": "hi"},
                           headers=bearer("acme")) as resp:
        assert resp.status == 200
    salts = [orjson.loads(s.body)["cache_salt"] for s in fake.completions()]
    acme_mine, beta_mine = namespaced_salt("acme", "mine"), namespaced_salt("beta-salt", "mine")
    assert salts == ["acme", "beta-salt", acme_mine, beta_mine,
                     namespaced_salt("beta-salt", "beta-salt"), "acme"]
    assert acme_mine.startswith("acme.") and len(acme_mine) == len("acme.") + 32
    assert len(set(salts[:5])) == 5  # no client salt reaches another namespace
    status, _, body = await post(client, url, bearer("acme"), cache_salt="a/b")
    assert status == 400 and body["error"]["code"] == "invalid_cache_salt"


def test_namespaced_salts_are_valid_for_vllm() -> None:
    from prompt.keyer import validate_cache_salt

    salt = namespaced_salt("t" * 95, "c" * 128)
    assert validate_cache_salt(salt) == salt
    assert namespaced_salt("t", None) == "t"
    assert namespaced_salt("t", "x") != namespaced_salt("u", "x")


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": []}', b'  \n {"model":"m"}', b"{}",
    b'{"model": "m", "cache_salt": "mine"}', b'{"x": {"cache_salt": "nested"}}',
])
def test_apply_salt_forwards_what_the_policy_sees(raw: bytes) -> None:
    access = Access(AuthSettings.model_validate(auth()), metrics=TenantMetrics(
        CollectorRegistry()), clock=lambda: 0.0)
    parsed = orjson.loads(raw)
    client = parsed.get("cache_salt")
    forwarded = access.tenants["acme"].apply_salt(parsed, raw)
    assert orjson.loads(forwarded) == parsed
    assert parsed["cache_salt"] == namespaced_salt("acme", client)


# ---------------------------------------------------------------- the oracle


async def test_routing_headers_only_for_trusted_tenants(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth(tenants=[
        {"name": "acme"}, {"name": "beta", "trusted": True},
        {"name": "slow", "routing_headers": True}, {"name": "narrow"}]))
    for tenant, shown in [("acme", False), ("beta", True), ("slow", True)]:
        status, headers, _ = await post(client, url, bearer(tenant))
        assert status == 200
        names = {h.lower() for h in headers}
        assert "x-request-id" in names
        assert ({"x-kvroute-replica", "x-kvroute-reason"} <= names) is shown, tenant
        assert any(n.startswith("x-kvroute-") for n in names) is shown, tenant


@pytest.mark.parametrize(("mode", "expect"), [
    ("trusted", {None: 401, "acme": 403, "beta": 200}),
    ("open", {None: 200, "acme": 200, "beta": 200}),
    ("disabled", {None: 404, "acme": 404, "beta": 404}),
])
async def test_debug_route_and_metrics_access_modes(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession,
        mode: str, expect: dict[str | None, int]) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth(debug_route=mode, metrics=mode))
    for who, status in expect.items():
        headers = bearer(who) if who else {}
        async with client.post(url + "/debug/route", json=chat(), headers=headers) as resp:
            assert resp.status == status, (who, "debug")
            body = await resp.json()
            if status != 200:
                assert set(body["error"]) >= {"message", "type", "code"}
        async with client.get(url + "/metrics", headers=headers) as resp:
            assert resp.status == status, (who, "metrics")


async def test_debug_route_is_trusted_only_by_default(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth())
    async with client.post(url + "/debug/route", json=chat()) as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    async with client.post(url + "/debug/route", json=chat(), headers=bearer("acme")) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "forbidden"
    async with client.post(url + "/debug/route", json=chat(), headers=bearer("beta")) as resp:
        assert resp.status == 200
    async with client.get(url + "/metrics") as resp:
        assert resp.status == 200  # scrapers bring no key; auth.metrics restricts it


# ---------------------------------------------------------------- limits


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=2.0, capacity=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.25) == pytest.approx(0.25)  # half a token back, not taken
    assert bucket.take(0.5) == 0.0
    assert bucket.take(100.0) == 0.0 and bucket.tokens == pytest.approx(2.0)  # capped


async def test_rate_limit_is_429_with_retry_after(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    url = await start_router([fake], auth=auth())
    statuses = []
    for _ in range(4):
        async with client.post(url + "/v1/chat/completions", json=chat(),
                               headers=bearer("slow")) as resp:
            statuses.append(resp.status)
            if resp.status == 429:
                assert 1 <= int(resp.headers["Retry-After"]) <= 100
                error = (await resp.json())["error"]
                assert error["code"] == "rate_limit_exceeded"
    assert statuses == [200, 200, 429, 429]
    status, _, _ = await post(client, url, bearer("acme"))  # other tenants unaffected
    assert status == 200
    assert len(fake.completions()) == 3
    metrics = await scrape(client, url)

    def count(tenant: str, outcome: str) -> float:
        return metrics[("router_tenant_requests_total",
                        (("outcome", outcome), ("tenant", tenant)))]

    assert (count("slow", "admitted"), count("slow", "rate_limited")) == (2, 2)
    assert (count("acme", "admitted"), count("acme", "rate_limited")) == (1, 0)
    tenants = {dict(labels).get("tenant") for (name, labels) in metrics
               if name.startswith("router_tenant_")}
    assert tenants == set(KEYS)  # configured names only: a bounded label set


async def test_concurrency_limit_is_429_and_slots_come_back(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.headers_delay_s = 1.0
    url = await start_router([fake], auth=auth())
    held = [asyncio.create_task(post(client, url, bearer("narrow"))) for _ in range(2)]
    while len(fake.completions()) < 2:
        await asyncio.sleep(0.01)
    async with client.post(url + "/v1/chat/completions", json=chat(),
                           headers=bearer("narrow")) as resp:
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    assert [(await t)[0] for t in held] == [200, 200]
    # A client that leaves mid-request gives its slot back too.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await post(client, url, bearer("narrow"))
    async with asyncio.timeout(10):
        while True:
            metrics = await scrape(client, url)
            gauges = {dict(labels)["tenant"]: v for (name, labels), v in metrics.items()
                      if name == "router_tenant_inflight_requests"}
            if gauges == dict.fromkeys(KEYS, 0.0):
                break
            await asyncio.sleep(0.05)
    fake.behaviour.headers_delay_s = 0.0
    again = await asyncio.gather(*(post(client, url, bearer("narrow")) for _ in range(2)))
    assert [status for status, _, _ in again] == [200, 200]
    assert metrics[("router_tenant_requests_total",
                    (("outcome", "concurrency_limited"), ("tenant", "narrow")))] == 1


def test_app_builds_without_auth() -> None:
    settings = RouterSettings.load(env={}, cli={"replicas": [{"url": "http://127.0.0.1:1"}]})
    assert not settings.auth.enabled and settings.auth.forwards_client_key
    create_app(settings, registry=CollectorRegistry())


class _Recording:
    """A policy that records the session key each request is routed with."""

    name = "recording"

    def __init__(self) -> None:
        self.sessions: list[str | None] = []

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        self.sessions.append(request.session_key)
        return Decision(replicas=tuple(candidates), policy=self.name, reason="recorded")

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        pass


async def test_tenants_never_share_a_session(
        fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession) -> None:
    (fake,) = await fakes(1)
    policy = _Recording()
    url = await start_router([fake], auth=auth(), policy="recording",
                             policy_factories={"recording": lambda ctx: policy})
    for tenant in ("acme", "beta"):
        await post(client, url, {**bearer(tenant), "X-Session-ID": "42"})
        await post(client, url, bearer(tenant), user="42")
    # The tenant qualifies the session, and the router keeps only its fixed-size hash.
    assert policy.sessions == [session_key(k) for k in ("acme:42", "acme:42", "beta:42",
                                                        "beta:42")]
