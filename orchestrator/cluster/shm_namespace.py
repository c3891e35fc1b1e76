"""A cluster's own ``/dev/shm``, private from its first byte.

Triton's Python backend makes its IPC regions 0644 whatever the umask, and they hold every
prompt and response; a local user who opens one before anyone changes its mode keeps
reading it. So a cluster's tritonservers on one host share a mount and IPC namespace of
their own, with a fresh tmpfs on ``/dev/shm`` (mode 0700): no other user's process sees the
regions at all, and NIXL/UCX between the nodes still finds them (posix and SysV shared
memory both in the namespace). One holder process keeps the namespace: made with
``unshare``, it mounts the tmpfs and sleeps; every tritonserver (the launcher's, the
supervisor's restarts and spares) is started with ``nsenter`` into it. Other processes
reach the regions through ``/proc/<holder>/root/dev/shm``, which only the cluster's user
may follow. A non-root user gets a user namespace too (mapped to itself as root inside).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.control.auth import UMASK, open_private

SHM_DIR = Path("/dev/shm")
# The holder: a tmpfs over /dev/shm, only its owner may enter it; then it waits forever.
_MOUNT = "mount -t tmpfs -o mode=0700,nosuid,nodev dejavu-shm /dev/shm && exec sleep infinity"


@dataclass(frozen=True)
class ShmNamespace:
    """The holder process of a cluster's namespace."""

    pid: int
    user: bool = False  # a user namespace too (the cluster's user is not root)

    def enter(self) -> list[str]:
        """The prefix that starts a command inside the namespace (nsenter execs it: the
        command keeps nsenter's pid)."""
        return [_tool("nsenter"), f"--target={self.pid}", "--mount", "--ipc",
                *(["--user", "--preserve-credentials"] if self.user else []), "--"]

    @property
    def shm_dir(self) -> Path:
        """The namespace's /dev/shm as seen from outside it."""
        return Path(f"/proc/{self.pid}/root/dev/shm")

    def describe(self) -> dict:
        return {"pid": self.pid, "user": self.user}

    @classmethod
    def from_state(cls, state: dict) -> ShmNamespace | None:
        """The namespace a cluster's state file records (None: none, regions in /dev/shm)."""
        held = state.get("namespace")
        return None if not held else cls(int(held["pid"]), bool(held["user"]))


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/bin/{name}"


def start_namespace(log_path: Path, timeout_s: float = 10.0) -> ShmNamespace | None:
    """A holder with a private /dev/shm, ready (the tmpfs mounted); None, said on stderr,
    where the host allows no such namespace (the regions then go to the host's /dev/shm
    and are made private as they appear: a local user may open one in that moment)."""
    user = os.geteuid() != 0
    command = [_tool("unshare"), *(["--user", "--map-root-user"] if user else []),
               "--mount", "--ipc", "--propagation", "private", "--", "sh", "-c", _MOUNT]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open_private(log_path, "ab") as log:
            holder = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      umask=UMASK)
    except OSError as exc:
        return _without(f"{command[0]}: {exc}")
    namespace = ShmNamespace(holder.pid, user)
    host = SHM_DIR.stat().st_dev
    deadline = time.monotonic() + timeout_s
    while holder.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # not mounted yet, or the holder is gone
            mounted = namespace.shm_dir.stat()
            if mounted.st_dev != host and stat.S_IMODE(mounted.st_mode) == 0o700:
                return namespace
        time.sleep(0.01)
    stop_namespace(namespace)
    return _without(f"unshare exited with {holder.poll()} (log {log_path})")


def stop_namespace(namespace: ShmNamespace | None) -> None:
    """End the holder: the tmpfs and what is left in it go once the namespace's last
    process has ended."""
    if namespace is None:
        return
    from orchestrator.cluster.tritonserver import stop_processes

    stop_processes([namespace.pid], timeout_s=5.0)


def _without(why: str) -> None:
    print(f"warning: no private /dev/shm for the cluster ({why}): the Python backend's "
          f"regions go to the host's /dev/shm, 0644 until they are made 0600 as they "
          f"appear; a local user may open one in that moment (docs/security.md)",
          file=sys.stderr)
    return None
