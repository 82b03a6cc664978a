"""Asking a vLLM replay ROUTER for the batches a subscriber missed.

The request is ``[b"", start_seq8]`` over a DEALER (REQ accepts only the first reply);
each retained batch with ``seq >= start`` comes back as ``[b"", topic, seq8, payload]``
(vLLM 0.28+) or ``[b"", seq8, payload]``, and an empty last frame ends the reply.  Every
wait has a timeout, and so has the whole replay.
"""

from __future__ import annotations

import asyncio
from typing import Final

import zmq
import zmq.asyncio

from aio.cancel import reraise_if_cancelling

__all__ = ["END_SEQ", "ReplayFailed", "fetch_replay"]

END_SEQ: Final = b"\xff" * 8


class ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered garbage."""


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    *,
    timeout_s: float,
    total_s: float,
) -> list[tuple[int, bytes]]:
    """Ask a vLLM replay ROUTER for every retained batch with ``seq >= start``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(endpoint)
        async with asyncio.timeout(total_s):
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(timeout_s * 1000)):
                    raise ReplayFailed(f"replay from {endpoint} timed out")
                frames = await sock.recv_multipart()
                if len(frames) < 3 or frames[0] != b"":
                    raise ReplayFailed(f"bad replay reply ({len(frames)} frames)")
                if frames[-1] == b"":
                    return out
                seq8 = frames[-2]
                if len(seq8) != 8 or len(frames) not in (3, 4):
                    raise ReplayFailed("bad replay sequence frame")
                out.append((int.from_bytes(seq8, "big"), frames[-1]))
    except TimeoutError as exc:
        reraise_if_cancelling()
        raise ReplayFailed(f"replay from {endpoint} exceeded {total_s:g} s") from exc
    except zmq.ZMQError as exc:
        reraise_if_cancelling()
        raise ReplayFailed(f"replay from {endpoint}: {exc}") from exc
    finally:
        sock.close(linger=0)
