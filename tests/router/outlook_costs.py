"""What the ``kv`` look ahead's state costs per use once the router has seen hours of
traffic, in one thread's CPU time.

``python -m tests.router.outlook_costs [--repeats R]``

``bench.kv_overhead`` runs a minute of traffic without pauses, so it never fills the
look ahead's bounded state.  This fills it and times what a decision reads:

* ``ThinkTimes.return_share`` with every one of its 2,048 pause-start buckets kept
  (about six hours of pauses, one a second, a third of them returning), read once per
  ``kv`` decision;
* ``displacement_curve`` over 300, 1,000 and 4,096 paused conversations on a replica
  (4,096 is ``IdleRuns``' bound per replica), recomputed at most every half second per
  replica on the event loop.

Prints the median over ``--repeats`` timings (each the mean of a batch of calls) and
the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from router.displacement import IdleRun, displacement_curve
from router.think_times import Returning, ThinkTimes

__all__ = ["main"]


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    load = os.getloadavg()[0]

    think = ThinkTimes()
    now = 0.0
    for i in range(30_000):  # one pause a second for over eight hours: every bucket kept
        now += 1.0
        think.paused(now)
        if i % 3 == 0:
            think.returned(60.0, now)
    share_us = _per_call_us(lambda: think.return_share(now), 2_000, args.repeats)
    print(f"return_share, 2,048 buckets kept: {share_us:.1f} us per decision")

    rng = random.Random(0)
    ret = Returning(0.4, tuple(sorted(rng.uniform(1.0, 300.0) for _ in range(8))))
    for n in (300, 1_000, 4_096):
        runs = [IdleRun(depth=rng.uniform(1.0, 30_000.0), run=rng.randint(10, 600),
                        elapsed_s=rng.uniform(0.0, 100.0)) for _ in range(n)]
        curve_us = _per_call_us(partial(displacement_curve, runs, 20.0, lambda e: ret),
                                20, args.repeats)
        print(f"displacement_curve, {n:,} paused conversations: {curve_us / 1000:.2f} ms")
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
