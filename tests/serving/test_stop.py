"""Stopping a node stops its whole process group, a child that ignores SIGTERM included;
cleaning up after it spares what its next incarnation made."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from orchestrator.cluster import tritonserver
from orchestrator.cluster.tritonserver import alive, stop_processes

# A leader that exits on SIGTERM, with a child that ignores it and would run on: what a
# tritonserver leaves when one of its Python-backend stubs hangs in its finalize.
LEADER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
child.wait()
"""


def test_a_stopped_servers_leftover_child_goes_too():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    assert alive(child)
    stop_processes([leader.pid], timeout_s=5.0)
    leader.wait(timeout=5)
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the child outlived its stopped leader"
        time.sleep(0.05)


def test_cleaning_a_nodes_shm_spares_its_next_incarnations(tmp_path, monkeypatch):
    # The supervisor may start a killed node again before its killer cleans up after it.
    monkeypatch.setattr(tritonserver, "SHM_DIR", tmp_path)
    regions = {name: tmp_path / name for name in [
        f"dejavu_frontend_9000_{uuid.uuid4()}", f"dejavu_frontend_9000_r1_{uuid.uuid4()}",
        f"dejavu_frontend_90001_{uuid.uuid4()}"]}
    for path in regions.values():
        path.touch()
    tritonserver.clean_shm("dejavu_frontend_9000_")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(list(regions)[1:])
