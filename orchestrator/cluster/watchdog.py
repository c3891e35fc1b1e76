"""The supervisor's keeper: ``dejavu up`` starts it beside the supervisor, and each of the
two starts the other again when it is gone (the supervisor keeps everything else: the
nodes, the frontend, the controller).

Whoever starts one writes its pid to ``<dir>/pids/<role>`` at once, before the new
process has even imported anything, so the other keeper never takes a starting one for
a lost one. ``dejavu down`` first leaves a ``<dir>/stopping`` mark, after which neither
starts anything again.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.cluster.tritonserver import ROOT, alive
from orchestrator.control.auth import UMASK, open_private

log = logging.getLogger("dejavu.watchdog")

STOPPING = "stopping"
STATE_FILE = "cluster.json"  # the cluster's state (orchestrator.cluster.launcher)
MODULES = {"supervisor": "orchestrator.cluster.supervisor",
           "watchdog": "orchestrator.cluster.watchdog"}


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a file beside it: a reader never sees it half written."""
    with open_private(path.with_suffix(".tmp")) as f:
        f.write(text)
    path.with_suffix(".tmp").replace(path)


def write_pid(run_dir: Path, role: str, pid: int) -> None:
    """Record ``pid`` as the cluster's ``role``."""
    path = run_dir / "pids" / role
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, f"{pid}\n")


def read_pid(run_dir: Path, role: str) -> int | None:
    try:
        return int((Path(run_dir) / "pids" / role).read_text())
    except (OSError, ValueError):
        return None


def stopping(run_dir: Path) -> bool:
    """The cluster is going down (or gone): start nothing again."""
    return (run_dir / STOPPING).exists() or not (run_dir / STATE_FILE).exists()


def start_module(args: list[str], log_path: Path) -> subprocess.Popen:
    """``python -m args`` in a session of its own (Ctrl-C in a shell must not stop it; a
    kill of its group takes its children too), its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open_private(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                umask=UMASK)


def spawn(run_dir: Path, role: str) -> subprocess.Popen:
    """Start the cluster's ``role`` (supervisor | watchdog), logging to ``logs/<role>.log``,
    and record its pid."""
    process = start_module([MODULES[role], "--dir", str(run_dir)],
                           run_dir / "logs" / f"{role}.log")
    write_pid(run_dir, role, process.pid)
    return process


def keep(run_dir: Path, role: str, child: subprocess.Popen | None) -> subprocess.Popen | None:
    """Start ``role`` again if it is gone; ``child``: the one this process started last
    (reaped here when it ends). Returns the one it started, if any."""
    if child is not None and child.poll() is None:
        return child
    pid = read_pid(run_dir, role)
    if pid is not None and alive(pid):
        return None  # alive, started by someone else
    if stopping(run_dir):
        return None
    log.warning("the %s is gone (pid %s); starting it again", role, pid)
    return spawn(run_dir, role)


def keeper_arguments(prog: str, description: str, poll_s: float,
                     argv: list[str] | None) -> argparse.Namespace:
    """The supervisor's and the watchdog's start: ``--dir`` and ``--poll-s``, logging, and
    an exit at once on SIGTERM (even mid-wait: what either started is on record)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--dir", type=Path, required=True, help="the cluster's folder")
    parser.add_argument("--poll-s", type=float, default=poll_s)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return args


def main(argv: list[str] | None = None) -> int:
    args = keeper_arguments(MODULES["watchdog"], __doc__.splitlines()[0], 0.5, argv)
    run_dir = args.dir.resolve()
    child = None
    while not stopping(run_dir):
        child = keep(run_dir, "supervisor", child)
        time.sleep(args.poll_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
