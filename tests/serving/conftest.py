"""Fixtures shared by the serving tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tiny_model: Callable[[str], Path]) -> Path:
    """The tiny Llama the serving tests run (4 layers: depth 2 and 3 split them unevenly)."""
    return tiny_model("llama")
