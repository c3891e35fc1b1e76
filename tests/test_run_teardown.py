"""A test run stopped with SIGTERM (a timeout, a cancelled CI job) leaves none of its
processes behind: tests/conftest.py turns the signal into an orderly end (fixtures torn
down) and stops any cluster still described in the run's temporary folders."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.cluster.tritonserver import ROOT

pytestmark = pytest.mark.slow
MARK = "DEJAVU_RUN_MARK"


def marked(mark: str) -> dict[int, str]:
    """The processes whose environment carries ``MARK=mark`` (inherited from the run), with
    their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone meanwhile, or not this user's
            continue
    return found


def wait_until(what: str, done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def test_sigterm_to_pytest_stops_its_clusters(tmp_path):
    mark, basetemp = uuid.uuid4().hex, tmp_path / "inner"
    # A module of cluster tests: its cluster (nodes, controller, OpenAI API, supervisor,
    # watchdog) is up for minutes, long enough to be stopped in the middle.
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
         "tests/serving/test_faults.py"],
        cwd=ROOT, env={**os.environ, MARK: mark}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("a cluster up with its supervisor",
                   lambda: any(basetemp.glob("**/pids/watchdog")) or run.poll() is not None, 300)
        assert run.poll() is None, run.stdout.read().decode()
        started = marked(mark)
        assert len(started) > 5, started  # the pytest, its nodes, their stubs, the helpers
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 128 + signal.SIGTERM, out.decode()
        deadline = time.monotonic() + 30  # a stub may take a moment after its server
        while marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not marked(mark)
    finally:
        for pid in marked(mark):  # left by a failure above: not by the next test
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
            run.wait(10)
