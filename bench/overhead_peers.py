"""Peer routers in ``bench.kv_overhead``: the same fake replicas and load in front of
sglang-router and vllm-router, inside a loopback-only network namespace.

``--peers standard`` runs the three peers the kv-overhead issue names, from the binaries
on ``PATH`` (or ``--peer-bin DIR``): sglang-router ``cache_aware`` (``smg launch``) and
vllm-router ``cache_aware`` and ``consistent_hash`` (``vllm-router``; consistent hashing
reads the ``X-Session-Id`` header every request carries).  ``--peer SPEC`` adds any other
(``bench.compare.PeerSpec``: ``name=...;cmd=...;ready=...``).

vllm-router's ``cache_aware`` gets token ids for every request from each worker's
``POST /v1/chat/completions/render`` (then ``/tokenize``), as from real vLLM.  The fake
replicas answer both, with toy ids (one per 4 bytes of the messages' text, so a longer
conversation's ids extend a shorter one's): the ids cost the replica almost nothing, so
the router's own cost is what is measured, as in ``../shared/docs/peers-measured.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.compare import PeerSpec
from bench.overhead_upstreams import ReplicaProtocol, http_response

__all__ = ["RenderingReplica", "RunningPeer", "standard_peers", "start_peers", "stop_peers",
           "toy_token_ids"]

_STANDARD = (
    ("sglang cache_aware", "smg", "{bin} launch --host 127.0.0.1 --port {port} --worker-urls "
     "{workers} --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port {aux} "
     "--log-level warn"),
    ("vllm cache_aware", "vllm-router", "{bin} --host 127.0.0.1 --port {port} --worker-urls "
     "{workers} --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port {aux} "
     "--log-level warning"),
    ("vllm consistent_hash", "vllm-router", "{bin} --host 127.0.0.1 --port {port} "
     "--worker-urls {workers} --policy consistent_hash --prometheus-host 127.0.0.1 "
     "--prometheus-port {aux} --log-level warning"),
)


def standard_peers(bin_dir: Path | None) -> list[PeerSpec]:
    """The three peers, with their binaries from ``bin_dir`` or ``PATH``; a missing one
    is an error naming the package to install."""
    out = []
    for name, exe, template in _STANDARD:
        path = (bin_dir / exe) if bin_dir is not None else shutil.which(exe)
        if path is None or not Path(path).exists():
            raise SystemExit(f"{exe} not found (pip install sglang-router vllm-router, or "
                             "--peer-bin DIR)")
        # ``{aux}`` stays a placeholder for ``PeerSpec.argv`` (a free port each).
        out.append(PeerSpec(name, template.replace("{bin}", str(path))))
    return out


def toy_token_ids(body: bytes) -> list[int]:
    """One id per 4 bytes of the messages' concatenated text (the fake replicas'
    render): prefix-stable across a conversation's turns, and nearly free."""
    try:
        messages = json.loads(body).get("messages") or []
        text = "".join(str(m.get("content", "")) for m in messages).encode()
    except (ValueError, AttributeError):
        return []
    return [i % 100_000 for i in array("I", text[: len(text) // 4 * 4])]


_RENDER_PATHS = (b"/v1/chat/completions/render", b"/v1/completions/render", b"/tokenize")


class RenderingReplica(ReplicaProtocol):
    """``ReplicaProtocol`` plus vLLM's render and tokenize endpoints (toy ids)."""

    def __init__(self) -> None:
        super().__init__()
        self._body: list[bytes] = []

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._body = []

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._url.startswith(_RENDER_PATHS):
            self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url
        if not url.startswith(_RENDER_PATHS):
            super().on_message_complete()
            return
        assert self._transport is not None
        ids = toy_token_ids(b"".join(self._body))
        answer = ({"count": len(ids), "max_model_len": 131072, "tokens": ids}
                  if url.startswith(b"/tokenize")
                  else {"request_id": "render", "token_ids": ids,
                        "sampling_params": {"max_tokens": 16}, "model": "bench-model"})
        self._transport.write(http_response("200 OK", b"application/json",
                                            json.dumps(answer).encode()))


@dataclass(frozen=True, slots=True)
class RunningPeer:
    """A started peer router."""

    spec: PeerSpec
    port: int
    proc: subprocess.Popen[bytes]


def start_peers(peers: Sequence[PeerSpec], replica_ports: Sequence[int],
                free_port: Callable[[], int], log_dir: Path) -> list[RunningPeer]:
    """Start every peer in front of the replicas (``free_port()`` for its ports); its
    output goes to ``log_dir/<name>.log``."""
    workers = [f"http://127.0.0.1:{p}" for p in replica_ports]
    out = []
    for spec in peers:
        port, aux = free_port(), free_port()
        argv = spec.argv(port, workers, aux=aux)
        log = (log_dir / (spec.name.replace(" ", "_") + ".log")).open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        out.append(RunningPeer(spec, port, proc))
    return out


def stop_peers(peers: Sequence[RunningPeer]) -> None:
    """Terminate every peer (killed after 10 s)."""
    for peer in peers:
        peer.proc.terminate()
    for peer in peers:
        try:
            peer.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer.proc.kill()
            peer.proc.wait()
