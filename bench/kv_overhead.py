"""What kv routing costs through the proxy: ``round_robin``, ``session`` and ``kv`` in one run.

``python -m bench.kv_overhead [--replicas N] [--phase-s S] [--rounds R] [--tokenizer DIR]
[--peers standard] [--peer SPEC] [--peer-bin DIR] [--profile-s S] [--py-spy PATH]
[--out FILE]``

The ``kv`` policy as it runs in production:

* the router has a configured model and tokenizer (``scoring.models``; by default the tiny
  byte-level BPE test tokenizer with a Llama-3 chat template, ``--tokenizer`` for another),
  so every request is rendered, hashed, looked up and scored;
* its index is populated by KV events: each fake replica publishes (ZMQ, vLLM's wire
  format, to every subscriber that connects) ``BlockStored`` events for the conversations
  it holds, rendered with the same tokenizer, so ``kv`` routes on real hits;
* the bodies are 32 multi-turn chats of 10 turns (about 25 KB of JSON each, the
  ``bench.proxy_overhead`` body); each request ends with one of 8 fresh last user
  messages, so the router renders a new tail after a known history, like a next turn.

One router process, one run: the policy is chosen per request with the policy header,
and the phases of the three policies, of each peer router (``bench.overhead_peers``: in
front of the same replicas, inside a loopback-only network namespace) and of the direct
path are interleaved round by round (best round kept).  Measured at concurrency 1
(p50/p99, added against direct) and 32 (req/s, router CPU per request), non-streaming.
The router's decisions are read from its ``/metrics`` afterwards (``kv`` must decide on
hits, or the run proves nothing), with the ``kv`` policy's own time per request by stage
(render, lookup, score, the rest of the decision), averaged over every ``kv`` request.

``--profile-s S`` then samples the router with ``py-spy`` (``--py-spy``, else on
``PATH``) for S seconds of ``kv`` load at concurrency 32 and prints where its CPU goes,
by component: HTTP server, upstream client, JSON, rendering, hashing, index, scoring,
metrics, event loop, other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.compare import PeerSpec, reexec_in_netns
from bench.overhead_peers import (
    RenderingReplica,
    RunningPeer,
    standard_peers,
    start_peers,
    stop_peers,
)
from bench.overhead_upstreams import chat_body
from bench.proxy_overhead import (
    PhaseResult,
    _Conn,
    _free_port,
    _pct,
    _pin,
    _wait_http,
    timed_run,
)

MODEL = "bench-model"
NETNS_ENV = "KVROUTE_BENCH_NETNS"
"""Set (to its name) inside the network namespace the benchmark re-executed itself in."""
BLOCK_SIZE = 16
CONVERSATIONS = 32
TAILS = 8
POLICIES = ("round_robin", "session", "kv")


def bodies(conversation: int) -> list[bytes]:
    """Conversation ``conversation``'s request bodies: its 10-turn history, then one of
    ``TAILS`` last user messages each."""
    base = json.loads(chat_body(False, seed=conversation))
    base["model"] = MODEL
    out = []
    for t in range(TAILS):
        body = dict(base)
        body["messages"] = [*base["messages"][:-1],
                            {"role": "user", "content": f"Follow-up {t}: " +
                             base["messages"][-1]["content"]}]
        out.append(json.dumps(body).encode())
    return out


def history(conversation: int) -> dict[str, Any]:
    """What a replica holds of a conversation: its history without the new tail."""
    base = json.loads(chat_body(False, seed=conversation))
    base["model"] = MODEL
    base["messages"] = base["messages"][:-1]
    return dict(base)


# --------------------------------------------------------------------------- replicas
def _serve_kv_replicas(ports: list[int], event_ports: list[int], tokenizer: str) -> None:
    """Fake replicas (``bench.proxy_overhead``'s instant answers) that each publish the
    KV events of the conversations they hold (conversation i on replica i % N)."""
    import uvloop

    blocks = _stored_events(len(ports), tokenizer)

    async def publish(i: int) -> None:
        import zmq
        import zmq.asyncio

        from index.events import KVEventBatch, encode_batch

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription
        sock.bind(f"tcp://127.0.0.1:{event_ports[i]}")
        seq = 0
        try:
            while True:
                msg = await sock.recv()
                if not msg or msg[0] != 1:
                    continue
                payload = encode_batch(KVEventBatch(ts=time.time(), events=blocks[i]))
                await sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                seq += 1
        finally:
            ctx.destroy(linger=0)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(RenderingReplica, "127.0.0.1", p, backlog=1024)
                   for p in ports]
        tasks = [asyncio.create_task(publish(i)) for i in range(len(ports))]
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        for t in tasks:
            t.cancel()
        for s in servers:
            s.close()

    uvloop.run(main())


def _stored_events(replicas: int, tokenizer: str) -> list[list[Any]]:
    from index.events import BlockStored
    from prompt.registry import ModelSpec, RendererRegistry

    registry = RendererRegistry([ModelSpec(name=MODEL, block_size=BLOCK_SIZE,
                                           tokenizer=tokenizer)])
    out: list[list[Any]] = [[] for _ in range(replicas)]
    engine_key = 1
    for c in range(CONVERSATIONS):
        tokens = registry.render_chat(history(c)).token_ids
        parent = None
        for b in range(len(tokens) // BLOCK_SIZE):
            out[c % replicas].append(BlockStored(
                block_hashes=[engine_key], parent_block_hash=parent,
                token_ids=list(tokens[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]), block_size=BLOCK_SIZE,
                lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                kv_cache_spec_kind="full_attention"))
            parent = engine_key
            engine_key += 1
    return out


# --------------------------------------------------------------------------- load
def _payload(port: int, body: bytes, policy: str | None, session: str) -> bytes:
    extra = f"x-kvroute-policy: {policy}\r\n" if policy else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nx-session-id: {session}\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def phase(ports: list[int], target: str, policy: str | None, concurrency: int,
                seconds: float, cpu_pid: int | None, load_pids: list[int]) -> PhaseResult:
    """``concurrency`` keep-alive connections, conversation i on connection i (mod 32),
    each request the next of its conversation's tails; the direct path sends conversation
    i to the replica that holds it."""
    conns = []
    plans: list[list[bytes]] = []
    for i in range(concurrency):
        c = i % CONVERSATIONS
        port = ports[c % len(ports)]
        conns.append(await _Conn.open(port))
        plans.append([_payload(port, b, policy, f"conv-{c}") for b in bodies(c)])
    lat: list[float] = []

    async def run(i: int, until: float, record: bool) -> None:
        n = i
        while time.perf_counter() < until:
            t, _ = await conns[i].request(plans[i][n % TAILS])
            n += 1
            if record:
                lat.append(t)

    warm = time.perf_counter() + min(0.3, seconds / 5)
    elapsed, cpu, share, gen, others = await timed_run(
        run, concurrency, warm, seconds, lat, cpu_pid, load_pids)
    for conn in conns:
        conn.close()
    lat.sort()
    return PhaseResult(target, False, concurrency, len(lat), elapsed, len(lat) / elapsed,
                       _pct(lat, 50) * 1e3, _pct(lat, 99) * 1e3, _pct(lat, 50) * 1e3, cpu,
                       share, gen, others)


async def measure(replica_ports: list[int], router_port: int, phase_s: float, rounds: int,
                  router_pid: int, replicas_pid: int,
                  peers: list[RunningPeer]) -> dict[str, dict[int, PhaseResult]]:  # fmt: skip
    """Best round per (target, concurrency); targets: direct, each policy, each peer."""
    best: dict[str, dict[int, PhaseResult]] = {}
    for concurrency in (1, 32):
        for _ in range(rounds):
            targets: list[tuple[str, str | None, list[int], int | None]] = [
                ("direct", None, replica_ports, None)]
            targets += [(p, p, [router_port], router_pid) for p in POLICIES]
            targets += [(x.spec.name, None, [x.port], x.proc.pid) for x in peers]
            for name, policy, ports, pid in targets:
                r = await phase(ports, name, policy, concurrency, phase_s, pid, [replicas_pid])
                cur = best.setdefault(name, {}).get(concurrency)
                better = (cur is None or (r.p50_ms < cur.p50_ms if concurrency == 1
                                          else r.rps > cur.rps))
                if better:
                    best[name][concurrency] = r
                cpu = (f" router CPU {r.router_cpu_us_per_request:.0f} us/req"
                       f" (share {r.cpu_share:.2f}, others {r.others_cpu:.2f} cores)"
                       if r.router_cpu_us_per_request is not None else "")
                print(f"  c={concurrency:<3} {name:20} {r.rps:7.0f} req/s p50 {r.p50_ms:6.3f} "
                      f"ms p99 {r.p99_ms:7.3f} ms{cpu}", flush=True)
    return best


# --------------------------------------------------------------------------- profile
_COMPONENTS = (
    ("HTTP server", ("uvicorn/", "httptools", "starlette/", "h11/", "router/conn_guard")),
    ("upstream client", ("aiohttp/", "yarl/", "multidict/", "aiohappyeyeballs")),
    ("rendering", ("prompt/render", "prompt/template", "prompt/chat", "prompt/message",
                   "prompt/tokenizer", "prompt/segments", "prompt/turns", "prompt/plain",
                   "prompt/registry", "prompt/conversation", "prompt/words",
                   "prompt/added_tokens", "prompt/token_ids", "(<template>", "jinja2/",
                   "tokenizers/", "router/kv_services")),
    ("hashing", ("kvkeys/", "prompt/keyer", "xxhash")),
    ("index", ("index/",)),
    ("scoring", ("router/kv_", "router/scoring", "router/horizon", "router/affinity",
                 "router/session", "router/provisional", "router/receipts",
                 "router/prefix_breaks", "router/replica_view", "router/fleet_outlook",
                 "router/displacement", "router/think_times", "router/idle_runs",
                 "router/move_cost", "router/service_times", "router/decision_counts",
                 "uhashring/")),
    ("metrics", ("router/metrics", "router/index_metrics", "prometheus_client/")),
    ("JSON + request parsing", ("router/request", "router/validate", "orjson", "json/",
                                "msgspec")),
    ("proxy", ("router/proxy", "router/relay", "router/usage", "router/load",
               "router/app", "router/policy")),
    ("event loop", ("asyncio/", "uvloop/")),
)


def component(frame: str) -> str:
    """The component a py-spy frame (``function (path:line)``) belongs to."""
    for name, needles in _COMPONENTS:
        if any(n in frame for n in needles):
            return name
    return "other"


def stack_component(stack: str) -> str:
    """The component of a py-spy stack (frames outermost first, ``;``-separated): its
    innermost frame's, or, where that is no component's (a dataclass's generated
    ``__init__``, the standard library's ``enum`` or ``typing``), the nearest caller's
    that is."""
    for frame in reversed(stack.split(";")):
        name = component(frame)
        if name != "other":
            return name
    return "other"


def profile(py_spy: str, router_pid: int, router_port: int, replica_ports: list[int],
            seconds: float, out: Path) -> dict[str, float]:
    """Sample the router under ``kv`` load; returns each component's share of the
    samples (``stack_component``)."""
    import uvloop

    raw = out.with_suffix(".pyspy.txt")
    spy = subprocess.Popen([py_spy, "record", "--pid", str(router_pid), "--duration",
                            str(int(seconds)), "--rate", "250", "--format", "raw",
                            "--nonblocking", "--output", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    uvloop.run(phase([router_port], "kv", "kv", 32, seconds, None, []))
    spy.wait(timeout=seconds + 30)
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        counts[stack_component(stack)] += int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.most_common()}


# --------------------------------------------------------------------------- main
def _router_config(path: Path, port: int, replica_ports: list[int], event_ports: list[int],
                   tokenizer: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "log_level": "warning", "policy": "kv",
        "replicas": [{"url": f"http://127.0.0.1:{p}", "id": f"r{i}", "models": [MODEL],
                      "kv_events_endpoint": f"tcp://127.0.0.1:{e}"}
                     for i, (p, e) in enumerate(zip(replica_ports, event_ports, strict=True))],
        "health": {"interval_s": 1.0},
        "scoring": {"models": [{"name": MODEL, "block_size": BLOCK_SIZE,
                                "tokenizer": str(tokenizer)}]},
    }))


def _router_metrics(port: int) -> tuple[dict[str, float], dict[str, float]]:
    """The router's decisions (``policy/reason`` -> count) and the ``kv`` policy's own
    time per request, in microseconds, averaged over every ``kv`` request of the run:
    its stages (``router_kv_stage_seconds``: render, lookup, score), the decision and
    its bookkeeping (``other``: the rest of ``router_route_seconds``) and the whole
    (``route``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    decisions: dict[str, float] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "router_decisions_total":
                decisions[f"{s.labels['policy']}/{s.labels['reason']}"] = s.value
            elif s.name.startswith(("router_kv_stage_seconds_", "router_route_seconds_")):
                name = s.labels.get("stage") or (
                    "route" if s.labels.get("policy") == "kv" else None)
                if name is not None and s.name.endswith("_sum"):
                    sums[name] = s.value
                elif name is not None and s.name.endswith("_count"):
                    counts[name] = s.value
    stages = {k: v / counts[k] * 1e6 for k, v in sums.items() if counts.get(k)}
    if "route" in stages:
        stages["other"] = stages["route"] - sum(
            stages.get(k, 0.0) for k in ("render", "lookup", "score"))
    return decisions, stages


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.kv_overhead",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--replicas", type=int, default=4, help="fake replicas (default 4)")
    p.add_argument("--phase-s", type=float, default=1.5, help="seconds per phase (1.5)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell (2)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory (default: the tiny test tokenizer, built once)")
    p.add_argument("--profile-s", type=float, default=0.0,
                   help="then sample the router with py-spy for this long (0: no profile)")
    p.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy binary")
    p.add_argument("--out", type=Path, default=Path("/tmp/kvroute-kv-overhead.json"))
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--peers", choices=("none", "standard"), default="none",
                   help="standard: sglang-router cache_aware, vllm-router cache_aware and "
                        "consistent_hash in front of the same replicas (bench.overhead_peers)")
    p.add_argument("--peer", action="append", default=[], metavar="SPEC",
                   help="another peer router: name=...;cmd=... {port} {workers} {aux}")
    p.add_argument("--peer-bin", type=Path, default=None,
                   help="directory of the peers' binaries (default: PATH)")
    args = p.parse_args(argv)
    peer_specs = (standard_peers(args.peer_bin) if args.peers == "standard" else [])
    peer_specs += [PeerSpec.parse(spec) for spec in args.peer]
    if peer_specs and not os.environ.get(NETNS_ENV):
        # peer routers may try to download tokenizers: they run only where nothing leaves
        return reexec_in_netns(NETNS_ENV, list(argv if argv is not None else sys.argv[1:]),
                               module="bench.kv_overhead")
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    import uvloop

    from bench.fleet import build_tokenizer_dir

    work = Path(tempfile.mkdtemp(prefix="kvroute-kv-overhead-"))
    tok = args.tokenizer or asyncio.run(build_tokenizer_dir(work / "tiny-model"))
    replica_ports = [_free_port() for _ in range(args.replicas)]
    event_ports = [_free_port() for _ in range(args.replicas)]
    router_port = _free_port()
    _pin(os.getpid(), {0}, pin)
    replicas = subprocess.Popen(
        [sys.executable, "-c", "import sys, json; from bench.kv_overhead import "
         "_serve_kv_replicas as s; s(*json.loads(sys.argv[1]))",
         json.dumps([replica_ports, event_ports, str(tok)])])
    config = work / "router.yaml"
    _router_config(config, router_port, replica_ports, event_ports, tok)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    router = subprocess.Popen([str(Path(sys.executable).with_name("kvroute")), "serve",
                               "--config", str(config)], env=env)
    peers = start_peers(peer_specs, replica_ports, _free_port, work)
    try:
        _pin(replicas.pid, {0}, pin)
        for pid in (router.pid, *(x.proc.pid for x in peers)):
            _pin(pid, {1}, pin)
        for port in replica_ports:
            _wait_http(port, "/health")
        _wait_http(router_port, "/ready")
        for x in peers:
            _wait_http(x.port, x.spec.ready_path)
        load_before = os.getloadavg()
        print(f"kv overhead: {args.replicas} replicas, {CONVERSATIONS} conversations of "
              f"{len(bodies(0)[0]) / 1024:.1f} KB, tokenizer {tok}, {args.rounds} x "
              f"{args.phase_s}s, pinned={pin}, load average {load_before[0]:.1f} "
              f"(a shared machine slows every figure)", flush=True)
        best = uvloop.run(measure(replica_ports, router_port, args.phase_s, args.rounds,
                                  router.pid, replicas.pid, peers))
        decisions, stages = _router_metrics(router_port)
        shares = (profile(args.py_spy, router.pid, router_port, replica_ports,
                          args.profile_s, args.out) if args.profile_s and args.py_spy else {})
        load_after = os.getloadavg()
    finally:
        stop_peers(peers)
        for proc in (router, replicas):
            proc.send_signal(signal.SIGTERM)
        for proc in (router, replicas):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report = _report(best, decisions, stages, shares, [x.spec.name for x in peers])
    args.out.write_text(json.dumps({
        "replicas": args.replicas, "phase_s": args.phase_s, "rounds": args.rounds,
        "loadavg_before": load_before, "loadavg_after": load_after, "pinned": pin,
        "tokenizer": str(tok), "peers": [x.command for x in peer_specs],
        "summary": report, "decisions": decisions, "kv_stages_us": stages,
        "cpu_by_component": shares,
        "best": {k: {str(c): asdict(r) for c, r in v.items()} for k, v in best.items()},
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


def _report(best: dict[str, dict[int, PhaseResult]], decisions: dict[str, float],
            stages: dict[str, float], shares: dict[str, float],
            peers: list[str]) -> dict[str, Any]:
    direct = best["direct"]
    rr = best["round_robin"][32]
    rr_cpu = rr.router_cpu_us_per_request or float("nan")
    out: dict[str, Any] = {}
    print(f"\n{'router':24} added p50   added p99   c32 req/s   CPU us/req   CPU vs rr")
    for name in (*POLICIES, *peers):
        c1, c32 = best[name][1], best[name][32]
        cpu = c32.router_cpu_us_per_request or float("nan")
        row = {"added_p50_ms": c1.p50_ms - direct[1].p50_ms,
               "added_p99_ms": c1.p99_ms - direct[1].p99_ms,
               "rps_c32": c32.rps, "rps_c32_vs_round_robin": c32.rps / rr.rps,
               "cpu_us_per_request_c32": cpu, "cpu_vs_round_robin": cpu / rr_cpu}
        out[name] = row
        label = f"kvroute {name}" if name in POLICIES else name
        print(f"{label:24} {row['added_p50_ms']:7.3f} ms {row['added_p99_ms']:8.3f} ms "
              f"{c32.rps:9.0f} {cpu:11.0f} {row['cpu_vs_round_robin']:9.2f}x")
    kv = out["kv"]
    for name in peers:
        kv[f"rps_c32_vs_{name.replace(' ', '_')}"] = kv["rps_c32"] / out[name]["rps_c32"]
    print(f"direct c32: {direct[32].rps:.0f} req/s; kv decisions: " + ", ".join(
        f"{k.split('/', 1)[1]} {v:.0f}" for k, v in sorted(decisions.items())
        if k.startswith("kv/")))
    if stages:
        print("kv's own time per request (router_kv_stage_seconds, every kv request): "
              + ", ".join(f"{k} {stages[k]:.0f} us" for k in
                          ("render", "lookup", "score", "other", "route") if k in stages))
    if peers:
        print("kv's c=32 throughput against each peer: " + ", ".join(
            f"{name} {kv['rps_c32'] / out[name]['rps_c32']:.1f}x" for name in peers))
    if shares:
        print("router CPU under kv load, by component: " + ", ".join(
            f"{k} {v:.0%}" for k, v in shares.items()))
    return out


if __name__ == "__main__":
    sys.exit(main())
