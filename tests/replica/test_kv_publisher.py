"""The simulated replica's KV event publisher speaks vLLM's ZMQ protocol exactly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from index.events import AllBlocksCleared, KVEventBatch, decode_batch, encode_batch
from replica.sim.kv_publisher import END_SEQ, KVEventPublisher, is_bind_endpoint


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def recv(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> list[bytes]:
    async with asyncio.timeout(timeout):
        frames: list[bytes] = await sock.recv_multipart()
        return frames


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await recv(dealer)
            out.append(frames)
            if frames[-1] == b"":
                return out
    finally:
        dealer.close(linger=0)


@contextlib.asynccontextmanager
async def subscribed(
    ctx: zmq.asyncio.Context, pub: KVEventPublisher
) -> AsyncIterator[zmq.asyncio.Socket]:
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(pub.endpoint)
    try:
        # Slow joiner: publish probes until one arrives, then drain.
        async with asyncio.timeout(5):
            while not await sub.poll(20):
                await pub.publish_raw(b"probe")
        while await sub.poll(50):
            await sub.recv_multipart()
        yield sub
    finally:
        sub.close(linger=0)


def test_bind_rule_is_vllms() -> None:
    assert is_bind_endpoint("tcp://*:5557")
    assert is_bind_endpoint("tcp://[::]:5557") and is_bind_endpoint("ipc:///tmp/x")
    assert is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://router:5557")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


async def test_live_frames_and_replay_formats(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", bind=True, topic="kv@p@m", context=ctx,
                                replay_endpoint="tcp://127.0.0.1:0",
                                data_parallel_rank=3) as pub:  # fmt: skip
        async with subscribed(ctx, pub) as sub:
            first = pub.next_seq
            seq = await pub.publish([AllBlocksCleared()], ts=12.5)
            assert seq == first
            topic, seq8, payload = await recv(sub)
            assert topic == b"kv@p@m" and seq8 == seq.to_bytes(8, "big")
            assert payload == encode_batch(KVEventBatch(12.5, [AllBlocksCleared()], 3))
            assert decode_batch(payload).data_parallel_rank == 3
        assert pub.resolved_replay_endpoint is not None
        msgs = await replay(ctx, pub.resolved_replay_endpoint, seq)
        assert msgs == [
            [b"", b"kv@p@m", seq.to_bytes(8, "big"), payload],
            [b"", b"", END_SEQ, b""],
        ]
        # Past the newest: only the end marker.
        assert await replay(ctx, pub.resolved_replay_endpoint, seq + 5) == [
            [b"", b"", END_SEQ, b""]
        ]


async def test_sequence_buffer_faults_and_legacy_replay(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", bind=True, buffer_steps=3, context=ctx,
                                replay_endpoint="tcp://127.0.0.1:0",
                                legacy_replay=True) as pub:  # fmt: skip
        assert pub.resolved_replay_endpoint is not None
        for i in range(5):
            assert await pub.publish_raw(bytes([i])) == i
        msgs = await replay(ctx, pub.resolved_replay_endpoint, 0)
        # Only the last 3 are retained; the reply silently starts at the oldest.
        assert [m[1] for m in msgs[:-1]] == [i.to_bytes(8, "big") for i in (2, 3, 4)]
        assert all(len(m) == 3 for m in msgs[:-1])
        assert msgs[-1] == [b"", END_SEQ, b""]
        # An invalid request is ignored and does not disturb the next valid one.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.resolved_replay_endpoint)
        await dealer.send_multipart([b"", b"short"])
        await dealer.send_multipart([b"", (4).to_bytes(8, "big")])
        assert (await recv(dealer))[1] == (4).to_bytes(8, "big")
        dealer.close(linger=0)
        async with subscribed(ctx, pub) as sub:
            pub.drop_next(1)
            dropped = await pub.publish_raw(b"dropped")
            sent = await pub.publish_raw(b"sent")
            assert sent == dropped + 1
            frames = await recv(sub)
            assert frames[1:] == [sent.to_bytes(8, "big"), b"sent"]
        msgs = await replay(ctx, pub.resolved_replay_endpoint, dropped)
        assert [m[2] for m in msgs[:-1]] == [b"dropped", b"sent"]
        pub.forget()
        assert await replay(ctx, pub.resolved_replay_endpoint, 0) == [[b"", END_SEQ, b""]]
        pub.restart()
        assert pub.next_seq == 0


async def test_connect_mode_and_ipc(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    # A non-wildcard tcp endpoint: the publisher connects to a SUB the router bound.
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.bind("tcp://127.0.0.1:0")
    endpoint = sub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    try:
        async with KVEventPublisher(endpoint.decode(), topic="t", context=ctx) as pub:
            async with asyncio.timeout(5):
                while not await sub.poll(20):
                    await pub.publish_raw(b"x")
            assert (await recv(sub))[0] == b"t"
    finally:
        sub.close(linger=0)
    ipc = f"ipc://{tmp_path}/kv.sock"
    async with KVEventPublisher(ipc, context=ctx) as pub:
        assert pub.endpoint == ipc
        async with subscribed(ctx, pub) as s2:
            await pub.publish_raw(b"y")
            assert (await recv(s2))[2] == b"y"


async def test_publish_before_start_is_an_error() -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", bind=True)
    with pytest.raises(RuntimeError):
        await pub.publish_raw(b"x")
    await pub.aclose()
    with pytest.raises(ValueError):
        KVEventPublisher("tcp://127.0.0.1:0", buffer_steps=0)
