"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Tiny models on 2 shared cores: threads cost more than they give.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(arch)`` -> folder of a seeded tiny checkpoint (gpt2, opt or llama).

    Each arch is written once per session and shared by every test that asks.
    """
    from orchestrator.engine.checkpoint import make_checkpoint

    made: dict[str, Path] = {}

    def make(arch: str = "gpt2") -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(arch, "tiny", tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return make
