"""Usage receipts: asking the replica for usage, hiding the extra chunk, and passing the
numbers to ``policy.record``; plus the ``UsageTap`` framing rules."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import orjson

from kvkeys.types import ReplicaId
from router.plugins import PolicyContext
from router.policy import Decision, Policy, Receipt, RouteRequest
from router.usage import UsageTap, inject_include_usage, usage_of_body
from tests.router.conftest import StartFakes, StartRouter
from tests.router.helpers import chat


class Predicting:
    """A test policy that predicts cached tokens, wants usage and keeps its receipts."""

    name = "predicting"

    def __init__(self) -> None:
        self.receipts: list[tuple[RouteRequest, Receipt]] = []

    async def route(self, request: RouteRequest, candidates: Sequence[ReplicaId]) -> Decision:
        return Decision(tuple(candidates), self.name, "test", prompt_tokens=11,
                        predicted_cached_tokens=5, want_usage=True)

    def record(self, request: RouteRequest, decision: Decision, receipt: Receipt) -> None:
        self.receipts.append((request, receipt))


async def _setup(fakes: StartFakes, start_router: StartRouter) -> tuple[str, Predicting, str]:
    (fake,) = await fakes(1)
    policy = Predicting()

    def factory(ctx: PolicyContext) -> Policy:
        return policy

    url = await start_router([fake], policy="predicting",
                             policy_factories={"predicting": factory})
    return url, policy, fake.url


async def test_usage_chunk_injected_and_stripped(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    url, policy, direct = await _setup(fakes, start_router)
    body = orjson.dumps(chat(stream=True))
    async with client.post(direct + "/v1/chat/completions", data=body) as resp:
        expected = await resp.read()
    async with client.post(url + "/v1/chat/completions", data=body,
                           headers={"X-Session-ID": "s1"}) as resp:
        got = await resp.read()
        assert resp.headers["x-kvroute-predicted-cached-tokens"] == "5"
        assert resp.headers["x-kvroute-reason"] == "test"
    assert got == expected  # the client sees exactly what it asked for
    assert b'"usage"' not in got
    request, receipt = policy.receipts[-1]
    assert request.session_key == "s1"
    assert receipt.ok and receipt.prompt_tokens == 11 and receipt.cached_tokens == 7
    assert receipt.ttfb_s is not None and receipt.ttfb_s > 0


async def test_client_asked_usage_is_kept(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    url, policy, direct = await _setup(fakes, start_router)
    body = orjson.dumps(chat(stream=True, stream_options={"include_usage": True}, user="u"))
    async with client.post(direct + "/v1/chat/completions", data=body) as resp:
        expected = await resp.read()
    async with client.post(url + "/v1/chat/completions", data=body) as resp:
        got = await resp.read()
    assert got == expected and b'"usage"' in got
    request, receipt = policy.receipts[-1]
    assert request.session_key == "u"
    assert (receipt.prompt_tokens, receipt.cached_tokens) == (11, 7)


async def test_non_streaming_receipt(
    fakes: StartFakes, start_router: StartRouter, client: aiohttp.ClientSession
) -> None:
    url, policy, _ = await _setup(fakes, start_router)
    body = orjson.dumps(chat())
    async with client.post(url + "/v1/chat/completions", data=body) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == 11
    _, receipt = policy.receipts[-1]
    assert receipt.ok and (receipt.prompt_tokens, receipt.cached_tokens) == (11, 7)


def test_inject_splices_or_merges() -> None:
    raw = b'{"model":"m","stream":true,"messages":[]}'
    out = inject_include_usage(raw, orjson.loads(raw))
    assert out == b'{"stream_options":{"include_usage":true},' + raw[1:]
    assert orjson.loads(out)["stream_options"] == {"include_usage": True}
    raw2 = b'{"stream":true,"stream_options":{"continuous_usage_stats":false},"messages":[]}'
    out2 = orjson.loads(inject_include_usage(raw2, orjson.loads(raw2)))
    assert out2["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    raw3 = b'{"stream":true,"stream_options":null}'
    assert orjson.loads(inject_include_usage(raw3, orjson.loads(raw3)))["stream_options"] == {
        "include_usage": True}


USAGE_EVENT = (b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
               b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n')
STREAM = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
          b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
          + USAGE_EVENT + b"data: [DONE]\n\n")


def test_tap_strips_usage_chunk_at_any_split() -> None:
    for cut in range(1, len(STREAM)):
        tap = UsageTap(strip=True)
        out = tap.feed(STREAM[:cut]) + tap.feed(STREAM[cut:]) + tap.flush()
        assert out == STREAM.replace(USAGE_EVENT, b""), cut
        assert (tap.prompt_tokens, tap.cached_tokens, tap.completion_tokens) == (9, 4, 2)


def test_tap_forwards_complete_events_at_once() -> None:
    tap = UsageTap(strip=True)
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert tap.feed(first + b'data: {"cho') == first
    assert tap.feed(b'ices":[]}\n\n') == b'data: {"choices":[]}\n\n'  # no usage: kept


def test_tap_passthrough_when_not_stripping() -> None:
    tap = UsageTap(strip=False)
    assert tap.feed(STREAM) == STREAM
    assert (tap.prompt_tokens, tap.cached_tokens, tap.completion_tokens) == (9, 4, 2)
    assert tap.flush() == b""


def test_tap_never_holds_unframed_streams() -> None:
    tap = UsageTap(strip=True)
    blob = b"x" * 70_000
    assert tap.feed(blob) == blob


def test_usage_of_body() -> None:
    none = (None, None, None)
    assert usage_of_body(b'{"usage":{"prompt_tokens":3}}') == (3, None, None)
    assert usage_of_body(b'{"x":1}') == none
    assert usage_of_body(b'{"usage": nope') == none
    assert usage_of_body(b'{"usage": null}') == none
    # only the top-level member counts; the rest is skipped, whatever it holds
    answer = {"choices": [{"message": {"content": "usage " * 5000, "usage": {"prompt_tokens": 1}}}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 11,
                        "prompt_tokens_details": {"cached_tokens": 5}}}
    assert usage_of_body(orjson.dumps(answer)) == (7, 5, 11)
    assert usage_of_body(b'["usage", {"usage": {"prompt_tokens": 3}}]') == none
    assert usage_of_body(b'"usage"') == none
    assert usage_of_body(b'{"usage": {"prompt_tokens": "3", "prompt_tokens_details": 1}}') == none
    assert usage_of_body(b'{"usage": {"prompt_tokens": 3}, "x": [1,') == none
