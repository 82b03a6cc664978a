"""The property tests' profile: deterministic unless a developer asks for randomness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci",
                    reason="a developer chose another profile on purpose")
def test_default_profile_is_derandomized_without_a_sticky_database() -> None:
    current = settings.default
    assert current is not None
    assert current.derandomize is True
    assert current.database is None
    assert current.print_blob is True


def test_dev_profile_is_randomised() -> None:
    dev = settings.get_profile("dev")
    assert dev.derandomize is False and dev.database is not None


def test_runs_repeat_exactly_leave_no_database_and_dev_randomises(tmp_path: Path) -> None:
    # The suite's conftest in a scratch project whose property records what it was given
    # and fails on some of it: each default run sees the same examples, fails the same
    # way (with a reproduction blob) and stores nothing that a later run would replay.
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_recorded.py").write_text(textwrap.dedent("""
        import os
        from pathlib import Path
        from hypothesis import given, strategies as st

        LOG = Path(os.environ["RECORD_TO"])

        @given(st.integers())
        def test_recorded(n: int) -> None:
            with LOG.open("a") as f:
                f.write(f"{n}\\n")
            assert n % 7 != 3
    """))

    def run(name: str, profile: str | None = None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
        if profile:
            env["HYPOTHESIS_PROFILE"] = profile
        env["RECORD_TO"] = str(tmp_path / name)
        env["PYTHONPATH"] = str(REPO)  # the conftest imports the suite's helpers
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--rootdir", str(tmp_path), str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr
        assert "@reproduce_failure" in done.stdout, done.stdout
        return (tmp_path / name).read_text().split()

    first, second = run("first"), run("second")
    assert first == second and len(first) > 1
    assert not (tmp_path / ".hypothesis" / "examples").exists()
    assert run("dev", "dev")[:20] != first[:20]
