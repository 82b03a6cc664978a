"""Loopback ports for test servers, chosen outside the kernel's ephemeral range.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` is an ephemeral port: between the
test closing its probe socket and the server binding it, any outgoing connection on the
machine (a client, a Redis link, pip) may be given the same port. Choosing below the
ephemeral range avoids that race; a bind probe still skips ports a listener holds.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _candidates() -> range:
    low, high = _ephemeral_range()
    if low - _LOWEST >= 1000:
        return range(_LOWEST, low)
    return range(max(high + 1, _LOWEST), 65536)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct loopback ports free a moment ago (``consecutive``: ``p, p+1, ...``)."""
    pool = _candidates()
    rng = random.SystemRandom()  # not the random module's state, which Hypothesis seeds
    for _ in range(1000):
        if consecutive:
            start = rng.randrange(pool.start, pool.stop - n)
            ports = list(range(start, start + n))
        else:
            ports = rng.sample(pool, n)
        if all(_bindable(p) for p in ports):
            return ports
    raise RuntimeError(f"no {n} free loopback ports in {pool}")


def free_port() -> int:
    """A loopback port free a moment ago, outside the ephemeral range."""
    return free_ports(1)[0]
