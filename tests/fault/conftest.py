"""Fixtures for the fault-tolerance tests: the controller as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from replicated_pipeline import SECRET  # the in-process pipelines' secret

from orchestrator.control.auth import ENV


def spawn(timeout_s: float, secret: bytes, port: int = 0) -> tuple[subprocess.Popen, str]:
    """Start the controller as its own process (``secret`` in its environment); returns it
    and the address it bound."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.fault.controller",
         "--port", str(port), "--timeout-s", str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=os.environ | {ENV: secret.hex()},
    )
    line = proc.stdout.readline()  # printed once bound; empty if it exits first
    if not line.startswith("controller listening on "):
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"the controller did not start (port {port}): {line!r}")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def controller_factory() -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    """``make(timeout_s, port)`` -> (process, address); every one is killed at the end."""
    started: list[subprocess.Popen] = []

    def make(timeout_s: float = 1.0, port: int = 0) -> tuple[subprocess.Popen, str]:
        proc, address = spawn(timeout_s, SECRET, port)
        started.append(proc)
        return proc, address

    yield make
    for proc in started:
        if proc.poll() is None:
            stop(proc)


@pytest.fixture(scope="module")
def controller() -> Iterator[str]:
    """One controller shared by a module; tests use their own pipelines.

    Its 1 s failure timeout is 20 beats of the tests' nodes: no false deaths on loaded CPUs.
    """
    proc, address = spawn(1.0, SECRET)
    yield address
    stop(proc)
