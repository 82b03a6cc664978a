"""The router's memory levels off under a stream of distinct sessions and prompts, at the
configured memo budgets (``tests.router.rss_stream``: a fresh process, the real app on
loopback, 2,000 new sessions with ~2 kB prompts and long client-chosen session
strings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rss_levels_off_at_the_configured_budget() -> None:
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.router.rss_stream", "2000"],
                         cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600,
                         check=True)
    marks: list[float] = orjson.loads(out.stdout.strip().splitlines()[-1])
    start, *fifths = marks
    # the memos fill in the first half of the stream (about 15 MB of budgets), then
    # eviction holds them: the second half adds next to nothing.  Without bounds in
    # bytes the same stream grew some 5 MB per 100 requests; with a dropped key trie
    # kept alive through the memo's trails, some 3 MB per 400 (16 MB in all).
    assert fifths[-1] - fifths[2] < 4.0, marks
    assert fifths[-1] - start < 60.0, marks
