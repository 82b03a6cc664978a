"""``kvroute bench import-trace`` then ``kvroute bench compare`` on the imported slice of
the Mooncake trace: the commands the published comparison runs, at a tiny size (real
``kvroute sim`` replicas and ``kvroute serve`` routers as child processes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hashtrace import single_token_words
from bench.trace import load

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_head300.jsonl"


def test_single_token_words_encode_to_one_token_each(llama3_dir: Path) -> None:
    from tokenizers import Tokenizer

    words = single_token_words(llama3_dir, limit=300)
    tok = Tokenizer.from_file(str(llama3_dir / "tokenizer.json"))
    assert len(words) == 300
    text = " " + " ".join(words)
    assert len(tok.encode(text, add_special_tokens=False).ids) == len(words)


KVROUTE = [sys.executable, "-m", "kvroute"]


def _import_slice(tmp_path: Path, llama3_dir: Path) -> tuple[Path, Path, dict[str, int]]:
    """The first 8 s of the committed slice as a chat trace; the output folder (holding
    the tokenizer) and the import's summary."""
    out = tmp_path / "cmp"
    shutil.copytree(llama3_dir, out / "tiny-model")
    trace = tmp_path / "trace.jsonl"
    done = subprocess.run(
        [*KVROUTE, "bench", "import-trace", str(SLICE), "--out", str(trace),
         "--duration-s", "8", "--tokenizer", str(out / "tiny-model")],
        capture_output=True, text=True, timeout=120, check=True)
    return out, trace, json.loads(done.stdout)


def _compare(out: Path, trace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``bench compare`` of the trace on two replicas of 1,024 blocks, two output tokens."""
    done = subprocess.run(
        [*KVROUTE, "bench", "compare", "--trace", str(trace), "--replicas", "2",
         "--num-blocks", "1024", "--max-tokens", "2", "--time-scale", "1",
         "--no-progress", "--out", str(out), *args],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.slow
def test_import_and_compare_at_a_tiny_size(tmp_path: Path, llama3_dir: Path) -> None:
    out, trace, summary = _import_slice(tmp_path, llama3_dir)
    assert summary["requests"] == len(load(trace)) > 10
    done = _compare(out, trace, "--policies", "session,kv", "--repeats", "2")
    assert "bound: pooled optimal" in done.stdout
    points = json.loads((out / "compare.json").read_text())["points"]
    assert sorted((p["policy"], p["repeat"]) for p in points) == [
        ("kv", 0), ("kv", 1), ("session", 0), ("session", 1)]
    assert "] " in done.stdout  # medians with their [min-max] spread
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 * summary["requests"]
    # Each repeat runs on a fresh fleet: other addresses, so the rings assign anew.
    addresses = [{r["replica"] for r in results if r["repeat"] == i} for i in (0, 1)]
    assert addresses[0] and addresses[1] and not addresses[0] & addresses[1]
    for p in points:
        assert p["errors"] == 0 and p["requests"] == summary["requests"]
        # Every request starts with the trace's shared first block: some of it is cached,
        # and no run beats the optimal bound.
        assert 0 < p["cached_share"] <= p["bounds"]["pooled_optimal"] + 1e-9


def test_router_workers_below_one_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [*KVROUTE, "bench", "compare", "--router-workers", "0",
         "--out", str(tmp_path / "cmp")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--router-workers must be at least 1" in done.stderr
    assert not (tmp_path / "cmp").exists()


@pytest.mark.slow
def test_compare_with_two_router_workers(tmp_path: Path, llama3_dir: Path) -> None:
    """Each kvroute target runs as ``kvroute serve --workers 2``; the run starts only once
    both workers have answered ``/ready`` with their event sources live (a single
    process never says it is worker 1, so the run would not start), and every request
    is served."""
    out, trace, _ = _import_slice(tmp_path, llama3_dir)
    done = _compare(out, trace, "--policies", "kv", "--router-workers", "2")
    assert "(kvroute with 2 workers)" in done.stderr
    [point] = json.loads((out / "compare.json").read_text())["points"]
    assert point["errors"] == 0 and point["requests"] == len(load(trace))
