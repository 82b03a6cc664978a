"""Fixtures for the deployment tests: the parsed deployment files and kvroute's parser.

Everything here reads the files as a user's tools would (YAML with anchors and merge keys
resolved, JSON), so a test sees what ``docker compose``, Prometheus and Grafana would see.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""

@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    """``docker-compose.yml`` as compose reads it (anchors and merge keys resolved)."""
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="session")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compose services by name."""
    found = compose["services"]
    assert isinstance(found, dict)
    return found


@pytest.fixture(scope="session")
def kvroute_parser() -> argparse.ArgumentParser:
    """kvroute's real command-line parser."""
    return build_parser()


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    """The provisioned Grafana dashboard."""
    data = json.loads((REPO / "deploy/grafana/dashboards/kvroute.json").read_text("utf-8"))
    assert isinstance(data, dict)
    return data
