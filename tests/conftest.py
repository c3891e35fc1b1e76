"""Fixtures shared by the whole suite."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

TERMINATED = pytest.StashKey[bool]()

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


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a timeout, a cancelled CI job) ends the run as Ctrl-C does, fixtures torn
    down: by default Python just dies, and the clusters its tests started (in sessions of
    their own, so that ``dejavu up`` outlives its shell) would run on. KeyboardInterrupt,
    not pytest.exit: only it also stops a run still collecting."""

    def end_run(signum: int, frame) -> None:
        signal.signal(signal.SIGTERM, lambda *_: None)  # a second one must not cut teardown
        config.stash[TERMINATED] = True
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, end_run)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run ended by SIGTERM exits with 128 + SIGTERM, as a process the signal killed."""
    if session.config.stash.get(TERMINATED, False):
        session.exitstatus = 128 + signal.SIGTERM


@pytest.fixture(scope="session", autouse=True)
def stop_clusters_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the run (torn down last), stop every cluster still described in this
    run's temporary folders: one whose own teardown was cut short, or a bench's."""
    yield
    from orchestrator.cluster.launcher import STATE_FILE, stop_described

    for folder, _, files in os.walk(tmp_path_factory.getbasetemp()):  # links not followed
        if STATE_FILE in files:
            with contextlib.suppress(Exception):  # the others are still stopped
                stop_described(folder)
            (Path(folder) / STATE_FILE).unlink(missing_ok=True)
