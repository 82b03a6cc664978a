"""``POST /debug/route`` on the real app (uvicorn) in front of fake replicas."""

from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry

from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat


async def test_dry_run_decision_with_breakdown(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    replicas = await fakes(3)
    prom = CollectorRegistry()
    url = await start_router(replicas, policy="kv", registry=prom)
    async with client.post(url + "/debug/route", json=chat(),
                           headers={"X-Session-ID": "abc"}) as resp:
        assert resp.status == 200
        d = await resp.json()
    # no model is configured for rendering: the decision is affinity on the session key
    assert d["policy"] == "kv" and d["reason"] == "affinity_no_prompt" and d["dry_run"]
    assert sorted(d["replicas"]) == sorted(r.url.removeprefix("http://") for r in replicas)
    rows = d["detail"]["replicas"]
    assert [row["replica"] for row in rows] == d["replicas"]
    assert d["detail"]["affinity_source"] == "session" and d["predicted_cached_tokens"] is None
    # the same session, asked again, gets the same answer, and nothing was sent or counted
    async with client.post(url + "/debug/route?endpoint=chat", json=chat(),
                           headers={"X-Session-ID": "abc"}) as resp:
        assert (await resp.json())["replicas"] == d["replicas"]
    assert all(not r.completions() for r in replicas)
    assert prom.get_sample_value("router_decisions_total",
                                 {"policy": "kv", "reason": "affinity_no_prompt"}) is None


async def test_other_policies_and_errors(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    replicas = await fakes(2)
    url = await start_router(replicas, policy="kv")
    async with client.post(url + "/debug/route", json=chat(),
                           headers={"X-KVRoute-Policy": "round_robin"}) as resp:
        d = await resp.json()
        assert d["policy"] == "round_robin" and d["dry_run"] is False
    async with client.post(url + "/debug/route", json={"model": "m", "prompt": "x"},
                           headers={"X-KVRoute-Policy": "session"}) as resp:
        d = await resp.json()
        assert d["policy"] == "session" and d["reason"] == "prompt_prefix"
    for data, headers, query, status in [
        (b"{", {}, "", 400),
        (b'{"model": "m"}', {}, "?endpoint=chat", 400),
        (b'{"model": "m", "messages": []}', {}, "?endpoint=bogus", 400),
        (b'{"model": "m", "messages": []}', {"X-KVRoute-Policy": "nope"}, "", 400),
        (b'{"model": "other", "messages": []}', {}, "", 404),
    ]:
        async with client.post(url + "/debug/route" + query, data=data,
                               headers=headers) as resp:
            assert resp.status == status, (data, query, await resp.text())
            assert "error" in await resp.json()

