"""The upstreams ``bench.proxy_overhead`` measures against: fake replicas that answer a
fixed chat completion (JSON or SSE) at raw-asyncio speed, a bare uvicorn app for
calibration, and the chat body the load sends.  Each server runs in its own process."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from typing import Any

__all__ = ["ReplicaProtocol", "chat_body", "echo_app", "http_response", "serve_echo",
           "serve_replicas"]

WORDS = ("the of and to in is that for it as was with be by on not he this are or his "
         "from at which but have an they you were her she there been one all we their "
         "model cache token block router replica prefix request stream latency").split()


def chat_body(stream: bool, seed: int = 0) -> bytes:
    """A ~25 KB multi-turn chat: a ~1,500-token system prompt plus ten turns."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    messages = [{"role": "system", "content": text(1500)}]
    for _ in range(10):
        messages.append({"role": "user", "content": text(180)})
        messages.append({"role": "assistant", "content": text(220)})
    messages.append({"role": "user", "content": text(60)})
    body: dict[str, Any] = {"model": "bench-model", "messages": messages, "max_tokens": 16,
                            "stream": stream}
    return json.dumps(body).encode()


_JSON = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "model": "bench-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 6000, "completion_tokens": 16, "total_tokens": 6016},
}).encode()
_SSE = b"".join(
    b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}).encode()
    + b"\n\n" for i in range(4)
) + b"data: [DONE]\n\n"
_MODELS = json.dumps({"object": "list", "data": [{"id": "bench-model", "object": "model"}]})


def http_response(status: str, ctype: bytes, body: bytes, chunked: bool = False) -> bytes:
    """One whole HTTP/1.1 response (content-length, or one chunk when ``chunked``)."""
    if chunked:
        return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype
                + b"\r\ntransfer-encoding: chunked\r\n\r\n"
                + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_R_JSON = http_response("200 OK", b"application/json", _JSON)
_R_SSE = http_response("200 OK", b"text/event-stream", _SSE, chunked=True)
_R_MODELS = http_response("200 OK", b"application/json", _MODELS.encode())
_R_HEALTH = http_response("200 OK", b"text/plain", b"")


class ReplicaProtocol(asyncio.Protocol):
    """A fake OpenAI replica on raw asyncio (httptools): fixed answers, no work."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpRequestParser(self)
        self._parse_error = httptools.HttpParserError
        self._url = b""
        self._stream = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except self._parse_error:
            # Not HTTP/1.1 (a client probing with the HTTP/2 preface, say): close the
            # connection, as an HTTP/1.1-only server does, so the client falls back.
            assert self._transport is not None
            self._transport.close()

    def on_message_begin(self) -> None:
        self._url = b""
        self._stream = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        if b'"stream": true' in body or b'"stream":true' in body:
            self._stream = True

    def on_message_complete(self) -> None:
        assert self._transport is not None
        url = self._url
        if url.startswith(b"/v1/chat") or url.startswith(b"/v1/completions"):
            self._transport.write(_R_SSE if self._stream else _R_JSON)
        elif url.startswith(b"/v1/models"):
            self._transport.write(_R_MODELS)
        else:
            self._transport.write(_R_HEALTH)


def serve_replicas(ports: list[int]) -> None:
    """Serve ``ReplicaProtocol`` on each port until SIGTERM (a child process's body)."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(ReplicaProtocol, "127.0.0.1", p, backlog=1024)
                   for p in ports]
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        for s in servers:
            s.close()

    uvloop.run(main())


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app that reads the body and answers the fixed JSON (calibration)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(_JSON)).encode())]})
    await send({"type": "http.response.body", "body": _JSON})


def serve_echo(port: int) -> None:
    """Bare uvicorn (uvloop, httptools) serving ``echo_app``: what a Python ASGI server
    costs per request on this machine right now, to normalise the router's cost."""
    import uvicorn

    uvicorn.run(echo_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                lifespan="off", access_log=False, log_level="warning")
