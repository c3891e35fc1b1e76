"""The supervisor's watch on its nodes' processes: a node whose tritonserver ended is
reported to the fault controller at once (``Lost``), so failover starts within
``period_s`` of a kill instead of after the heartbeat timeout.

A thread of its own: the supervisor's loop may be busy for seconds (starting a node,
driving a recovery) while another node dies. It reads the state file each time (the
supervisor rewrites it when a spare takes a stage over or a node starts again) and
reports each process once. ``alive`` reaps the supervisor's own children, so a node it
started and lost is seen at once, not as a zombie.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.cluster.launcher import read_state
from orchestrator.cluster.tritonserver import alive, proc_stat
from orchestrator.cluster.watchdog import read_pid, stopping, write_pid
from orchestrator.fault.client import report_lost
from orchestrator.fault.rpc import Stub

log = logging.getLogger("dejavu.pid_watch")

WATCHED_ROLES = ("decode", "prefill")  # the nodes the controller watches
WATCHING = "supervisor.watching"  # pids/<this>: the supervisor whose watch runs


PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is in its exit
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's pending-signal masks


def dying(pid: int) -> bool:
    """Killed, not yet ended: in its exit, or a SIGKILL pending. A killed tritonserver on a
    loaded machine took 15 s to end here (heartbeats had stopped with its stubs at once)."""
    try:
        if int(proc_stat(pid)[6]) & PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            masks = [line.split()[1] for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, IndexError, ValueError):
        return False  # gone meanwhile: alive() says so
    return any(int(mask, 16) & SIGKILL_BIT for mask in masks)


def lost_nodes(state: dict, reported: set[int]) -> list[dict]:
    """The watched nodes whose process is gone or dying, not yet reported (``reported``:
    pids)."""
    return [node for node in state["nodes"]
            if node["role"] in WATCHED_ROLES and node.get("pid")
            and node["pid"] not in reported
            and (not alive(node["pid"]) or dying(node["pid"]))]


def watching(run_dir: Path) -> bool:
    """Whether the cluster's supervisor, as it is now, watches its nodes' processes (it
    starts importing seconds before: a kill meanwhile is found by the heartbeat timeout)."""
    pid = read_pid(run_dir, "supervisor")
    return pid is not None and read_pid(run_dir, WATCHING) == pid


class PidWatch(threading.Thread):
    def __init__(self, run_dir: Path, secret: bytes, period_s: float = 0.05,
                 on_lost: Callable[[], None] = lambda: None) -> None:
        """``on_lost``: called after each report (the supervisor acts on it at once)."""
        super().__init__(name="pid-watch", daemon=True)
        self.run_dir, self.secret, self.period_s = run_dir, secret, period_s
        self.on_lost = on_lost
        self.reported: set[int] = set()
        self.stop = threading.Event()
        self._stub: Stub | None = None

    def run(self) -> None:
        write_pid(self.run_dir, WATCHING, os.getpid())
        while not self.stop.wait(self.period_s) and not stopping(self.run_dir):
            try:
                state = read_state(self.run_dir)
            except (OSError, json.JSONDecodeError):
                continue  # gone (the cluster is down) or being replaced: next time
            for node in lost_nodes(state, self.reported):
                self.report(state["controller"]["address"], node)

    def report(self, controller: str, node: dict) -> None:
        name = node["config"]["name"]
        log.warning("%s (pid %d) ended: telling the controller", name, node["pid"])
        if self._stub is None or self._stub.address != controller:
            if self._stub is not None:
                self._stub.close()
            self._stub = Stub(controller, self.secret)
        if report_lost(self._stub, name, f"its tritonserver (pid {node['pid']}) ended"):
            self.reported.add(node["pid"])  # else the controller is away: again next time
            self.on_lost()
