"""A clock warp file: one owner moves the offset forward, every mapping of the file reads
it at once, and it never moves back."""

from __future__ import annotations

from pathlib import Path

import pytest

from aio.clock_warp import ClockWarp


def test_every_mapping_reads_what_the_owner_advanced(tmp_path: Path) -> None:
    path = tmp_path / "warp"
    owner = ClockWarp.create(path)
    reader = ClockWarp.open(path)
    try:
        assert owner.offset() == reader.offset() == 0.0
        owner.advance(1.5)
        owner.advance(0.25)
        assert reader.offset() == 1.75
        with pytest.raises(ValueError, match="forward"):
            owner.advance(-1.0)
        assert reader.offset() == 1.75
    finally:
        owner.close()
        reader.close()
    assert ClockWarp.open(path).offset() == 1.75  # the file outlives its mappings


def test_create_starts_again_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "warp"
    first = ClockWarp.create(path)
    first.advance(3.0)
    first.close()
    assert ClockWarp.create(path).offset() == 0.0


def test_a_missing_or_foreign_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ClockWarp.open(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_bytes(b"\x00\x00")
    with pytest.raises(OSError, match="not a clock warp file"):
        ClockWarp.open(short)
