"""The fault soak, shortened to cover each fault once: replicas killed and restarted,
Redis killed, restarted and flushed, event batches dropped and corrupted, clients leaving
mid-stream.  No request may be lost and the index must be exact again afterwards.

``kvroute bench soak`` runs the same for 5 minutes (``--duration 300``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import FAULTS, SoakSpec, passed, run_soak
from bench.soak_fleet import SoakFleetSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def test_nothing_is_lost_and_the_index_recovers(llama3_dir: Path, tmp_path: Path) -> None:
    spec = SoakSpec(
        SoakFleetSpec(llama3_dir, replicas=3, log_dir=tmp_path / "logs"),
        duration_s=45.0, conversations=4, fault_interval_s=5.0, sample_interval_s=3.0,
        recovery_conversations=4,
    )  # fmt: skip
    report = await run_soak(spec)
    summary = report.to_json()
    assert set(report.faults) == set(FAULTS), summary
    assert report.failed == 0 and not report.failures, summary  # zero lost requests
    assert report.unhandled_exceptions == 0, (tmp_path / "logs" / "router.log").read_text()
    assert report.sent == (report.completed + report.abandoned + report.mid_stream_errors
                           + report.failed)  # fmt: skip
    assert report.completed > 0 and report.abandoned > 0
    # Recovered: every source live again, and later turns of fresh conversations are
    # predicted exactly (never over).
    assert report.recovered_after_s is not None, summary
    assert report.checked_after_recovery >= 4, summary
    # The recovered index never claims a block the replica does not hold; an
    # under-prediction is a turn whose events were still in flight on a loaded machine.
    assert report.over_after_recovery == 0, summary
    assert report.exact_after_recovery >= 0.75 * report.checked_after_recovery, summary
    assert passed(report)
    _assert_memory_and_fds_bounded(report.samples, spec.duration_s)


def _assert_memory_and_fds_bounded(samples: list[dict[str, float]], duration_s: float) -> None:
    """The router's RSS levels off once its memos are full (the soak's ~11 MB budgets,
    ``bench.soak_fleet.SOAK_MEMORY``, fill in the first seconds of traffic), and its open
    fds stay near where they began.

    Bounds in requests, not seconds, and with room for the allocator's steps, so that a
    slow (loaded) machine only sends fewer requests: from halfway through the traffic to
    the end the router may grow by 16 MiB plus 4 KiB per request sent meanwhile, where a
    per-request leak of the kind seen with unbounded memos grew ~20 KiB per request."""
    first, last = samples[0], samples[-1]
    half = next(s for s in samples if s["t"] >= duration_s / 2)
    sent = last["sent"] - half["sent"]
    assert sent > 0, samples
    assert last["rss_mib"] - half["rss_mib"] <= 16 + 4 * sent / 1024, samples
    assert max(s["rss_mib"] for s in samples) <= first["rss_mib"] + 96, samples
    # Open file descriptors come back to where they were (no leak per request or fault)
    # and never pile up (connections to killed replicas and Redis are closed).
    assert last["open_fds"] <= first["open_fds"] + 40, samples
    assert max(s["open_fds"] for s in samples) <= first["open_fds"] + 80, samples
