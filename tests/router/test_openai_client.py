"""The official ``openai`` client works through the router unchanged."""

from __future__ import annotations

import openai

from tests.router.conftest import StartFakes, StartRouter


async def test_openai_client_streaming_and_not(fakes: StartFakes,
                                               start_router: StartRouter) -> None:
    a, b = await fakes(2)
    url = await start_router([a, b])
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        completion = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
        assert completion.choices[0].message.content in ("from r0", "from r1")
        assert completion.usage is not None and completion.usage.prompt_tokens == 11

        pieces: list[str] = []
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces) in ("r0-0 r0-1 r0-2 ", "r1-0 r1-1 r1-2 ")

        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Request-Id": "oa-1"})
        assert raw.headers["x-request-id"] == "oa-1"
        assert raw.headers["x-kvroute-replica"]

        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]

        try:
            await client.chat.completions.create(
                model="unknown", messages=[{"role": "user", "content": "hi"}])
        except openai.NotFoundError as exc:
            assert exc.status_code == 404
            assert isinstance(exc.body, dict) and exc.body["code"] == "model_not_found"
        else:
            raise AssertionError("expected a 404")


async def test_openai_client_sees_midstream_error(fakes: StartFakes,
                                                  start_router: StartRouter) -> None:
    (fake,) = await fakes(1)
    fake.behaviour.drop_after_chunks = 1
    url = await start_router([fake])
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        try:
            async for _ in stream:
                pass
        except openai.APIError as exc:
            assert "mid-stream" in exc.message
        else:
            raise AssertionError("expected the stream to end with an error")
