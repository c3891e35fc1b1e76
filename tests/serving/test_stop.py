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


def test_a_clusters_namespace_has_its_own_dev_shm_and_goes_with_its_holder(tmp_path):
    """What the cluster's nodes see as /dev/shm: a fresh 0700 tmpfs, shared by every
    process entered into the namespace, absent from the host's; reached from outside
    through the holder; gone once the holder and its last process have ended."""
    import os
    import stat

    from orchestrator.cluster.shm_namespace import SHM_DIR, start_namespace, stop_namespace

    namespace = start_namespace(tmp_path / "namespace.log")
    assert namespace is not None, (tmp_path / "namespace.log").read_text()
    try:
        name = f"dejavu_test_{uuid.uuid4()}"
        made = subprocess.run([*namespace.enter(), sys.executable, "-c",
                               f"open('/dev/shm/{name}', 'w').write('x'); import os; "
                               f"print(oct(os.stat('/dev/shm').st_mode & 0o777))"],
                              capture_output=True, text=True, timeout=30)
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip() == "0o700"
        assert not (SHM_DIR / name).exists()
        assert [p.name for p in tritonserver.shm_regions("dejavu_test_", namespace)] == [name]
        assert stat.S_IMODE(os.stat(namespace.shm_dir).st_mode) == 0o700
    finally:
        stop_namespace(namespace)
    assert not alive(namespace.pid)
    assert tritonserver.shm_regions("dejavu_test_", namespace) == []
