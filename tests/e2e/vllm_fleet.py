"""Helpers for the end-to-end tests on real vLLM: replica processes and an event tap.

``VllmReplica`` owns one real vLLM OpenAI server process (the CPU build in
``.venv-vllm``) started from a ``replica.vllm.launcher.VllmReplicaSpec``: it starts it in
its own process group with the output appended to a log file, waits for ``/health``,
and can ``kill()`` it (SIGKILL to the whole group: a crash), ``stop()`` it (SIGTERM, then
SIGKILL) and ``restart()`` it on the same ports and endpoints.  ``start_replicas`` starts
several at once and waits for all of them (startup dominates the e2e run on 2 cores).

``EventTap`` subscribes to a replica's KV events the way a router does: a ZMQ SUB on the
PUB endpoint, read by a background thread, with vLLM's framing checked on every message
(3 frames: topic, 8-byte big-endian sequence number, msgpack batch) and each batch
decoded with ``index.events.decode_batch``.  Because a SUB misses what is published
before its subscription reaches the publisher (the slow joiner), and because events are
published by a thread of the engine slightly after the HTTP response, ``settle()`` waits
until the stream is quiet and then asks the replay socket (DEALER, ``[b"", seq8]``) for
everything after the last sequence number seen, so a test sees every batch, in order,
exactly once.

Used by ``conftest.py`` (fixtures) and imported by the e2e test modules as
``vllm_fleet`` (``conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from index.events import DecodedBatch, decode_batch
from replica.vllm.launcher import VllmReplicaSpec, dial_endpoint, launch
from tests.ports import free_port

END_SEQ = b"\xff" * 8
"""The replay end marker's sequence frame (``(-1).to_bytes(8, "big", signed=True)``)."""




def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (for failure messages)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class VllmReplica:
    """One real vLLM replica process and everything a test needs to talk to it."""

    spec: VllmReplicaSpec
    log_path: Path
    model_dir: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    """How many times the process has been started (1 after the first start)."""

    @property
    def id(self) -> str:
        """The replica's id (as it would appear in the router config)."""
        return self.spec.id

    @property
    def url(self) -> str:
        """Base URL of the OpenAI server, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def served_model_name(self) -> str:
        """The ``model`` clients send."""
        return self.spec.served_model_name

    @property
    def events_endpoint(self) -> str:
        """Where a SUB connects for the live KV event stream."""
        return dial_endpoint(self.spec.kv_events_endpoint, "127.0.0.1")

    @property
    def replay_endpoint(self) -> str:
        """Where a DEALER connects to replay buffered event batches."""
        assert self.spec.replay_endpoint is not None
        return dial_endpoint(self.spec.replay_endpoint, "127.0.0.1")

    @property
    def topic(self) -> str:
        """The first frame of every event message."""
        return self.spec.resolved_topic

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.spec.block_size

    @property
    def num_gpu_blocks(self) -> int:
        """``--num-gpu-blocks-override``: the pool size vLLM is given, null block included."""
        assert self.spec.num_gpu_blocks is not None
        return self.spec.num_gpu_blocks

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV: vLLM keeps block 0 as the null block."""
        return self.num_gpu_blocks - 1

    @property
    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        """The API server's process id (the leader of its process group)."""
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Start the process (not waiting for health); a no-op if it is running."""
        if self.alive:
            return
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start #{self.starts + 1} at {time.ctime()} =====\n".encode())
        self.process = launch(self.spec, log_path=self.log_path)
        self.starts += 1

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Block until ``GET /health`` answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.alive:
                    raise RuntimeError(
                        f"vLLM replica {self.id} exited with {self.process and self.process.poll()}"
                        f"; log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"vLLM replica {self.id} not healthy after {timeout_s:.0f} s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """Crash the replica: SIGKILL its whole process group (API server, engine core,
        worker) and reap it."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)

    def stop(self, grace_s: float = 20.0) -> None:
        """Shut the replica down (SIGTERM to the group, SIGKILL after ``grace_s``)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The engine core and worker may outlive the API server briefly.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def restart(self, timeout_s: float = 300.0) -> None:
        """Bring the replica back on the same ports and endpoints (after ``kill``/``stop``
        or while running); returns once it is healthy.  Its event sequence starts at 0
        again and its prefix cache is empty."""
        self.stop()
        self.start()
        self.wait_healthy(timeout_s)

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` (dev mode): empties the cache and makes vLLM publish
        ``AllBlocksCleared``."""
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=30.0)
        r.raise_for_status()


def start_replicas(replicas: Sequence[VllmReplica], timeout_s: float = 300.0) -> None:
    """Start all ``replicas`` at once and wait until every one is healthy; on failure
    stop them all and re-raise."""
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy(timeout_s)
    except BaseException:
        for r in replicas:
            r.stop(grace_s=5.0)
        raise


def replica_spec(
    *,
    index: int,
    model_dir: Path,
    python: str,
    workdir: Path,
    served_model_name: str,
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
) -> VllmReplicaSpec:
    """The spec of e2e replica number ``index``: loopback HTTP on a free port, events on a
    private ``ipc://`` PUB (vLLM binds ``tcp`` PUB endpoints only on the wildcard, and
    tests bind loopback only), replay on a free loopback TCP port, dev mode on."""
    port = free_port()
    return VllmReplicaSpec(
        model=str(model_dir),
        served_model_name=served_model_name,
        port=port,
        host="127.0.0.1",
        replica_id=f"vllm-{index}",
        block_size=block_size,
        kv_events_endpoint=f"ipc://{workdir}/vllm-{index}-events",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic=f"kv@vllm-{index}@{served_model_name}",
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        cpu=True,
        cpu_kvcache_gib=1,
        cpu_threads=1,
        dev_mode=True,
        python=python,
    )


@dataclass(frozen=True, slots=True)
class TappedBatch:
    """One event message as received: frames checked, payload decoded."""

    topic: bytes
    seq: int
    payload: bytes
    batch: DecodedBatch
    via_replay: bool


@dataclass
class EventTap:
    """A SUB on a replica's KV events, plus replay to fill what the SUB missed."""

    events_endpoint: str
    replay_endpoint: str | None
    topic: bytes = b""
    received: list[TappedBatch] = field(default_factory=list)
    frame_errors: list[str] = field(default_factory=list)
    _ctx: zmq.Context[zmq.Socket[bytes]] = field(default_factory=zmq.Context)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _last_arrival: float = 0.0
    _baseline: int = -1

    def __enter__(self) -> EventTap:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Connect and start receiving; then learn the replica's newest sequence number
        through replay so that only batches published from now on are reported."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(5.0)
        baseline = self._replay_after(None)
        with self._lock:
            self._baseline = max((b.seq for b in baseline), default=-1)
            self.received = [b for b in self.received if b.seq > self._baseline]

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._ctx.term()

    def _run(self, ready: threading.Event) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.events_endpoint)
        ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart()
                self._accept(frames, via_replay=False)
        finally:
            sub.close(0)

    def _accept(self, frames: list[bytes], *, via_replay: bool) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            with self._lock:
                self.frame_errors.append(f"bad framing: {[len(f) for f in frames]}")
            return
        topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        tapped = TappedBatch(topic, seq, payload, decode_batch(payload), via_replay)
        with self._lock:
            self._last_arrival = time.monotonic()
            if seq <= self._baseline:
                return
            if any(b.seq == seq for b in self.received):
                return
            self.received.append(tapped)
            self.received.sort(key=lambda b: b.seq)

    def _replay_after(self, last: int | None) -> list[TappedBatch]:
        """Every buffered batch with ``seq > last`` (all of them for ``None``)."""
        if self.replay_endpoint is None:
            return []
        start = 0 if last is None else last + 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[TappedBatch] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(10_000):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint}")
                frames = dealer.recv_multipart()
                if frames[-1] == b"":
                    break  # end marker: [b"", (b"",) END_SEQ, b""]
                body = frames[1:]  # strip the empty delimiter
                if len(body) == 3:
                    topic, seq_b, payload = body
                else:  # vLLM <= 0.24 replays without the topic frame
                    topic, (seq_b, payload) = b"", body[-2:]
                seq = int.from_bytes(seq_b, "big")
                out.append(TappedBatch(topic, seq, payload, decode_batch(payload), True))
        finally:
            dealer.close(0)
        return out

    def settle(self, quiet_s: float = 0.4, timeout_s: float = 15.0) -> None:
        """Wait until no batch arrived for ``quiet_s``, then fill gaps and the tail from
        the replay buffer."""
        deadline = time.monotonic() + timeout_s
        time.sleep(quiet_s)
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self._last_arrival
            if idle >= quiet_s:
                break
            time.sleep(quiet_s - idle)
        with self._lock:
            seen = [b.seq for b in self.received]
        last = self._baseline
        if seen:
            # Replay from the first hole (or after the newest batch) onwards.
            expected = last + 1
            for s in seen:
                if s != expected:
                    break
                expected += 1
            last = expected - 1
        for b in self._replay_after(last):
            self._accept_replayed(b)

    def _accept_replayed(self, b: TappedBatch) -> None:
        with self._lock:
            if b.seq <= self._baseline:
                return
            if any(x.seq == b.seq for x in self.received):
                return
            self.received.append(b)
            self.received.sort(key=lambda x: x.seq)

    def mark(self) -> int:
        """A position in the stream: pass it to ``since`` later."""
        with self._lock:
            return self.received[-1].seq if self.received else self._baseline

    def since(self, mark: int) -> list[TappedBatch]:
        """Batches with ``seq > mark``, in order (call ``settle`` first)."""
        with self._lock:
            return [b for b in self.received if b.seq > mark]

    def iter_all(self) -> Iterator[TappedBatch]:
        """Every batch received since the tap started, in order."""
        with self._lock:
            items = list(self.received)
        yield from items
