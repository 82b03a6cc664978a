"""Subcommands of ``kvroute`` that belong to ``replica``."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: "argparse._SubParsersAction[Any]") -> None:
    """Add this layer's subcommands to the ``kvroute`` parser."""
