"""clients.common's /proc readers: what each process group holds, the CPU it used, and a
run's CPU meter with its CPU-bound rule."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from clients.common import CpuMeter, CpuUse, cpu_seconds, process_groups


def test_this_process_group_is_counted():
    mine = process_groups()[os.getpgrp()]
    assert mine["processes"] >= 1
    assert mine["threads"] >= threading.active_count()
    assert mine["fds"] >= 3  # stdin, stdout, stderr at least
    assert mine["rss_kb"] > 0


BURN = """
import time
start = time.process_time()
while time.process_time() - start < 0.25:  # a quarter second of CPU, then idle on stdin
    pass
print("burnt", flush=True)
input()
"""


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_cpu_seconds_counts_a_groups_cpu_not_its_sleep():
    burner, sleeper = _child(BURN), _child("print('up', flush=True); input()")
    try:
        assert burner.stdout.readline() == "burnt\n"
        assert sleeper.stdout.readline() == "up\n"
        burnt, slept = cpu_seconds({burner.pid}), cpu_seconds({sleeper.pid})
        assert 0.24 <= burnt < 2.0
        assert slept < burnt  # its start-up only: waiting costs no CPU
        assert cpu_seconds({burner.pid, sleeper.pid}) == pytest.approx(burnt + slept, abs=0.05)
        assert cpu_seconds(set()) == 0
    finally:
        for child in (burner, sleeper):
            child.stdin.close()
            child.wait(timeout=10)


def test_cpu_meter_measures_a_run_and_flags_cpu_bound():
    burner = _child(BURN)
    try:
        with CpuMeter({burner.pid}, every_s=0.05) as meter:
            assert burner.stdout.readline() == "burnt\n"
        use = meter.use
        assert use is not None and use.cores == os.cpu_count()
        assert 0.2 <= use.cluster_cpu_s < 2.0 and use.wall_s > 0
        assert use.cluster_cores == pytest.approx(use.cluster_cpu_s / use.wall_s)
        assert 0 <= use.host_busy_cores <= use.cores + 0.01 and use.load_avg >= 0
    finally:
        burner.stdin.close()
        burner.wait(timeout=10)
    # The rule: the cluster above half the cores, or the host above 80% of them.
    quiet = CpuUse(wall_s=10, cluster_cpu_s=4, host_busy_cores=1.0, load_avg=3, cores=2)
    assert quiet.cluster_cores == 0.4 and not quiet.cpu_bound
    assert CpuUse(10, 11, 1.5, 3, 2).cpu_bound  # the cluster: 1.1 of 2 cores
    assert CpuUse(10, 1, 1.7, 3, 2).cpu_bound  # the host 85% busy
