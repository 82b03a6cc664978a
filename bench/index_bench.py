"""KV index benchmark: ingest throughput, lookup latency, memory per block.

``python -m bench.index_bench [--blocks 1000000] [--redis-url URL | --no-redis] [--json FILE]``

What it measures (targets from the index issue):

* **ingest**: blocks/s through the real path, msgpack payload -> ``decode_batch`` ->
  ``EventIngestor.apply`` (request keys hashed from token ids, parents resolved) -> the
  store; batches of 8 ``BlockStored`` events of 16 blocks of 16 tokens, chained like
  conversations.  Targets: >= 200,000/s in memory, >= 50,000/s into Redis.
* **lookup**: a 400-block prompt across 16 replicas (4 hold all of it, the others
  prefixes of random length, one holds its first blocks only in CPU memory) with
  ``--blocks`` (1,000,000) blocks indexed; median and p99 of ``await index.lookup``.
  Targets: median < 100 us in memory, < 1 ms against Redis on loopback.
* **memory per block**: ``tracemalloc`` over a fresh ``InMemoryIndex`` filled with
  200,000 blocks; Redis ``INFO used_memory`` before/after ingest divided by blocks.

Filling Redis to 1,000,000 blocks through the event path alone would take longer than
the benchmark's time bound on a slow box: the event path runs for part of
``--redis-budget`` (its rate is the ingest figure), then large ``apply`` batches (the
same Lua script) fill up to ``--blocks``; the JSON says how many blocks each path added.

Redis: ``--redis-url`` (a database the benchmark may write to; it uses its own key
prefix and deletes it afterwards), else a private ``redis-server`` started on a free
loopback port if one is on ``PATH``, else the Redis rows are skipped.  Bounded: well
under two minutes at the defaults on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from index.event_applier import EventIngestor
from index.events import BlockStored, KVEventBatch, decode_batch, encode_batch
from index.memory import InMemoryIndex
from index.redis_store import RedisIndex
from index.store import AddOp, KVIndex
from kvkeys.keys import block_keys
from kvkeys.types import EngineKey, Medium, ReplicaId, RequestKey

BS = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 8
REPLICAS = 16
PROMPT_BLOCKS = 400
MODEL = "bench-model"
_LAST_CPU_RATE = [0.0]  # blocks per CPU second of this process in the last _ingest


def _payloads(total_blocks: int, seed: int) -> list[tuple[ReplicaId, bytes]]:
    """Encoded batches spread round-robin over the replicas, chained per conversation."""
    rng = random.Random(seed)
    out: list[tuple[ReplicaId, bytes]] = []
    per_batch = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    n_batches = max(1, total_blocks // per_batch)
    next_hash = 1
    parents: dict[int, int | None] = {}
    for b in range(n_batches):
        r = b % REPLICAS
        events: list[Any] = []
        for _ in range(EVENTS_PER_BATCH):
            # Continue this replica's current conversation, or start a new one.
            parent = parents.get(r) if rng.random() < 0.75 else None
            hashes: list[int | bytes] = list(range(next_hash, next_hash + BLOCKS_PER_EVENT))
            next_hash += BLOCKS_PER_EVENT
            tokens = list(array("H", rng.randbytes(2 * BS * BLOCKS_PER_EVENT)))
            events.append(BlockStored(hashes, parent, tokens, BS, None, "GPU", None))
            parents[r] = next_hash - 1
        payload = encode_batch(KVEventBatch(time.time(), events, 0))
        out.append((ReplicaId(f"replica-{r}"), payload))
    return out


async def _ingest(
    index: KVIndex, payloads: list[tuple[ReplicaId, bytes]], budget_s: float = 1e9
) -> tuple[float, int]:
    """Blocks/s through decode + ingest, and how many batches fit in ``budget_s``."""
    ingestors: dict[ReplicaId, EventIngestor] = {}
    blocks = 0
    done = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    for rid, payload in payloads:
        ing = ingestors.get(rid)
        if ing is None:
            ing = ingestors[rid] = EventIngestor(index, rid, MODEL)
        result = await ing.apply(decode_batch(payload))
        blocks += result.blocks_stored
        done += 1
        if done % 64 == 0 and time.perf_counter() - t0 > budget_s:
            break
    _LAST_CPU_RATE[0] = blocks / max(time.process_time() - c0, 1e-9)
    return blocks / (time.perf_counter() - t0), done


async def _bulk_fill(index: KVIndex, blocks: int, seed: int, budget_s: float) -> int:
    """Top the index up with ``blocks`` random blocks (large batches), within a budget."""
    rng = random.Random(seed)
    added = 0
    t0 = time.perf_counter()
    chunk = 4096
    while added < blocks and time.perf_counter() - t0 < budget_s:
        n = min(chunk, blocks - added)
        rid = ReplicaId(f"replica-{(added // chunk) % REPLICAS}")
        eks = [EngineKey(rng.getrandbits(64)) for _ in range(n)]
        rks = [RequestKey(rng.getrandbits(64)) for _ in range(n)]
        await index.apply(rid, [AddOp(eks, rks)])
        added += n
    return added


async def _add_prompt_holders(index: KVIndex, seed: int) -> list[RequestKey]:
    rng = random.Random(seed)
    prompt = [rng.randrange(32000) for _ in range(PROMPT_BLOCKS * BS)]
    keys = block_keys(prompt, BS, model=MODEL)
    for r in range(REPLICAS):
        n = PROMPT_BLOCKS if r < 4 else rng.randrange(1, PROMPT_BLOCKS)
        eks = [EngineKey(rng.getrandbits(64)) for _ in range(n)]
        await index.add(ReplicaId(f"replica-{r}"), eks, keys[:n])
        if r == 5:
            await index.evict(ReplicaId(f"replica-{r}"), eks[:20])
            await index.add(ReplicaId(f"replica-{r}"), eks[:20], keys[:20], Medium.CPU)
    return keys


async def _lookups(index: KVIndex, keys: list[RequestKey], n: int) -> dict[str, float]:
    for _ in range(min(50, n)):
        await index.lookup(keys)
    times: list[float] = []
    cpu: list[float] = []
    hits = None
    for _ in range(n):
        c0 = time.process_time()
        t0 = time.perf_counter()
        hits = await index.lookup(keys)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert hits is not None and hits.best() == PROMPT_BLOCKS and len(hits.by_replica) == REPLICAS
    times.sort()
    return {
        "median_us": statistics.median(times) * 1e6,
        "p99_us": times[int(len(times) * 0.99) - 1] * 1e6,
        "mean_us": statistics.fmean(times) * 1e6,
        "cpu_median_us": statistics.median(cpu) * 1e6,
    }


def _memory_per_block(blocks: int, seed: int) -> float:
    rng = random.Random(seed)
    eks = [EngineKey(rng.getrandbits(64)) for _ in range(blocks)]
    rks = [RequestKey(rng.getrandbits(64)) for _ in range(blocks)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = InMemoryIndex()
    step = blocks // REPLICAS
    for r in range(REPLICAS):
        index.add_sync(ReplicaId(f"replica-{r}"), eks[r * step : (r + 1) * step],
                       rks[r * step : (r + 1) * step])  # fmt: skip
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # The key ints themselves were allocated before tracing began: count them too (the
    # index keeps references to them), 32 bytes per 64-bit int.
    return used / (step * REPLICAS) + 2 * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _private_redis() -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="kvroute-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


async def _bench_memory(
    payloads: list[tuple[ReplicaId, bytes]], target_blocks: int, lookups: int
) -> dict[str, Any]:
    index = InMemoryIndex()
    t0 = time.monotonic()
    rate, _ = await _ingest(index, payloads)
    cpu_rate = _LAST_CPU_RATE[0]
    t1 = time.monotonic()
    keys = await _add_prompt_holders(index, 7)
    # the event path's batches are whole: top up to exactly the target size
    held = sum(index.blocks(r) for r in await index.replicas())
    await _bulk_fill(index, target_blocks - held, 13, budget_s=60.0)
    lat = await _lookups(index, keys, lookups)
    blocks = sum(index.blocks(r) for r in await index.replicas())
    return {"ingest_blocks_per_s": rate, "ingest_blocks_per_cpu_s": cpu_rate,
            "indexed_blocks": blocks, "lookup": lat, "ingest_seconds": t1 - t0}  # fmt: skip


async def _redis_blocks(index: RedisIndex) -> int:
    return sum([await index.blocks(ReplicaId(f"replica-{r}")) for r in range(REPLICAS)])


async def _bench_redis(
    url: str, payloads: list[tuple[ReplicaId, bytes]], target_blocks: int, lookups: int,
    budget_s: float, cleanup: bool = True,
) -> dict[str, Any]:  # fmt: skip
    prefix = f"kvbench{random.randrange(1 << 30)}"
    sync = redis.Redis.from_url(url)
    index = RedisIndex.from_url(url, key_prefix=prefix, op_timeout_s=5.0, write_timeout_s=30.0)
    try:
        before = int(sync.info("memory")["used_memory"])
        t0 = time.monotonic()
        # The event path for a bounded time (its rate is the figure), then bulk adds
        # to reach the target size for the lookup measurement.
        rate, done = await _ingest(index, payloads, budget_s * 0.4)
        cpu_rate = _LAST_CPU_RATE[0]
        ingested = sum(BLOCKS_PER_EVENT * EVENTS_PER_BATCH for _ in range(done))
        keys = await _add_prompt_holders(index, 7)
        held = await _redis_blocks(index)
        filled = await _bulk_fill(index, target_blocks - held, 11, budget_s * 0.6)
        t1 = time.monotonic()
        after = int(sync.info("memory")["used_memory"])
        blocks = await _redis_blocks(index)
        lat = await _lookups(index, keys, lookups)
        return {
            "ingest_blocks_per_s": rate,
            "ingest_blocks_per_client_cpu_s": cpu_rate,
            "event_path_blocks": ingested,
            "bulk_filled_blocks": filled,
            "indexed_blocks": blocks,
            "lookup": lat,
            "bytes_per_block": (after - before) / max(blocks, 1),
            "fill_seconds": t1 - t0,
        }
    finally:
        await index.aclose()
        if cleanup:
            batch: list[bytes] = []
            for key in sync.scan_iter(match=f"{prefix}:*", count=10_000):
                batch.append(key)
                if len(batch) >= 10_000:
                    sync.unlink(*batch)
                    batch.clear()
            if batch:
                sync.unlink(*batch)
        sync.close()


def _table(results: dict[str, Any]) -> str:
    rows = [("metric", "memory", "redis", "target")]
    mem, red = results["memory"], results.get("redis")

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    rows.append(
        (
            "ingest blocks/s",
            fmt(mem["ingest_blocks_per_s"], ",.0f"),
            fmt(red and red["ingest_blocks_per_s"], ",.0f"),
            ">=200k / >=50k",
        )
    )
    rows.append(
        (
            "blocks indexed",
            fmt(mem["indexed_blocks"], ",d"),
            fmt(red and red["indexed_blocks"], ",d"),
            "1,000,000",
        )
    )
    rows.append(
        (
            "lookup median (us)",
            fmt(mem["lookup"]["median_us"], ".1f"),
            fmt(red and red["lookup"]["median_us"], ".1f"),
            "<100 / <1000",
        )
    )
    rows.append(
        (
            "lookup p99 (us)",
            fmt(mem["lookup"]["p99_us"], ".1f"),
            fmt(red and red["lookup"]["p99_us"], ".1f"),
            "",
        )
    )
    rows.append(("bytes per block", fmt(results["memory_bytes_per_block"], ".0f"),
                 fmt(red and red["bytes_per_block"], ".0f"), "measured"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


async def run(
    blocks: int, redis_url: str | None, use_redis: bool, lookups: int, redis_budget_s: float = 30.0
) -> dict[str, Any]:
    """Run every measurement; the result is what ``--json`` writes."""
    t0 = time.monotonic()
    payloads = _payloads(blocks - 10_000, seed=1)  # the prompt holders and a top-up add the rest
    results: dict[str, Any] = {
        "config": {"blocks": blocks, "replicas": REPLICAS, "prompt_blocks": PROMPT_BLOCKS,
                   "block_size": BS, "blocks_per_event": BLOCKS_PER_EVENT,
                   "events_per_batch": EVENTS_PER_BATCH},
    }  # fmt: skip
    results["memory"] = await _bench_memory(payloads, blocks, lookups)
    results["memory_bytes_per_block"] = _memory_per_block(200_000, seed=3)
    budget = max(10.0, redis_budget_s)
    if use_redis:
        if redis_url is not None:
            results["redis"] = await _bench_redis(redis_url, payloads, blocks, lookups, budget)
        else:
            with _private_redis() as url:
                if url is not None:
                    results["redis"] = await _bench_redis(
                        url, payloads, blocks, lookups, budget, cleanup=False
                    )
    results["seconds"] = time.monotonic() - t0
    results["load_average"] = list(os.getloadavg())
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.index_bench``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.index_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--no-redis", action="store_true")
    p.add_argument(
        "--redis-budget",
        type=float,
        default=30.0,
        help="seconds for filling Redis (event path, then bulk adds)",
    )
    p.add_argument("--json", metavar="FILE", default=None)
    args = p.parse_args(argv)  # fmt: skip
    results = asyncio.run(
        run(args.blocks, args.redis_url, not args.no_redis, args.lookups, args.redis_budget)
    )
    print(_table(results))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
