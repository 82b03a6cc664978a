"""Receipts: prediction error, large disagreements, and calibration."""

from __future__ import annotations

import pytest

from kvkeys.types import ReplicaId
from router.receipts import ReceiptCalibration, check_receipt

A = ReplicaId("a")


@pytest.mark.parametrize(
    ("predicted", "actual", "prompt", "outcome", "error", "large"),
    [
        (480, 480, 500, "match", 0, False),
        (480, 0, 500, "over", -480, True),
        (480, 448, 500, "over", -32, False),
        (0, 496, 500, "under", 496, True),
        (4800, 4736, 5000, "over", -64, False),
        (4800, 4000, 5000, "over", -800, True),
        (480, None, 500, "missing", None, False),
    ],
)
def test_check_receipt(predicted: int, actual: int | None, prompt: int, outcome: str,
                       error: int | None, large: bool) -> None:
    c = check_receipt(A, predicted, actual, prompt)
    assert (c.outcome, c.error, c.large) == (outcome, error, large)


def test_calibration_learns_shortfalls_and_recovers() -> None:
    cal = ReceiptCalibration(weight=0.5, floor=0.2)
    assert cal.trust(A) == 1.0
    cal.observe(A, 0, 100)  # no prediction: nothing learned
    cal.observe(A, 100, None)
    assert cal.trust(A) == 1.0
    cal.observe(A, 100, 0)
    assert cal.trust(A) == pytest.approx(0.5)
    for _ in range(10):
        cal.observe(A, 100, 0)
    assert cal.trust(A) == pytest.approx(0.2)
    for _ in range(20):
        cal.observe(A, 100, 200)  # over-delivery counts as 1, never above
    assert 0.99 < cal.trust(A) <= 1.0
    cal.forget(A)
    assert cal.trust(A) == 1.0
