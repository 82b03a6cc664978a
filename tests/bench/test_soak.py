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
        duration_s=45.0, conversations=4, fault_interval_s=5.0, sample_interval_s=5.0,
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
    # Open file descriptors come back to where they were (no leak per request or fault).
    first, last = report.samples[0], report.samples[-1]
    assert last["open_fds"] <= first["open_fds"] + 40, report.samples
