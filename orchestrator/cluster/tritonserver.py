"""One real ``tritonserver`` process: its files, its ports, its life.

The binary, the Python backend and its stubs ship inside the ``nvidia-pytriton``
wheel. A node gets a backend directory (the 3.11 stub next to
``libtriton_python.so``: only that stub links Debian's libpython), a model
repository assembled from ``model_repository/`` and ``backends/python/`` with
per-node parameters, three free loopback ports and a log file.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytriton

from orchestrator.cluster.devices import Devices
from orchestrator.cluster.shm_namespace import SHM_DIR, ShmNamespace
from orchestrator.control.auth import UMASK, open_private

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "model_repository"
MODEL_CODE = ROOT / "backends" / "python"
WHEEL = Path(pytriton.__file__).resolve().parent / "tritonserver"
WHEEL_LIBS = WHEEL.parents[1] / "nvidia_pytriton.libs"
# Triton APIs no client may call: on the client-facing frontend, those that reach into the
# server's memory, logs or models; on internal nodes, all but inference and health (the
# launcher's readiness probe). Nothing in the cluster calls them.
PUBLIC_RESTRICTED = ("shared-memory", "model-repository", "trace", "logging")
INTERNAL_RESTRICTED = (*PUBLIC_RESTRICTED, "metadata", "model-config", "statistics")
# Triton 2.51 opens a restricted API to the request whose header (key, value) matches its
# rule, and takes the rule from argv only, where every local user reads it. So the rule names
# a header no client can send: a line feed in the value (HTTP/1.1 and HTTP/2 forbid it in a
# field value; Triton's HTTP server drops such a request) and, for gRPC, which prefixes the
# key with ``triton-grpc-protocol-``, an upper-case letter in the key too (HTTP/2 forbids it
# in a field name and gRPC resets the stream; gRPC does pass a line feed in a value).
LOCKED_HTTP = "dejavu-locked=no client\nsends this"
LOCKED_GRPC = "Dejavu-Locked=no client\nsends this"


class ServerError(RuntimeError):
    """A tritonserver that would not start, or died."""


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, below the kernel's ephemeral range: a port from
    that range may be taken by some outgoing connection before the server binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ServerError("no free loopback port below the ephemeral range")


def make_backend_dir(dest: Path) -> Path:
    """``dest/python`` with the backend library, its utils and the 3.11 stub."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(WHEEL / "backends" / "python" / name, python_dir / name)
    stub = WHEEL / "python_backend_stubs" / "3.11" / "triton_python_backend_stub"
    shutil.copy2(stub, python_dir / stub.name)
    for path in python_dir.iterdir():  # copy2 kept the wheel's modes: the user's alone
        path.chmod(path.stat().st_mode & 0o700)
    return dest


def _parameter(key: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'parameters {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}\n'


DECOUPLED = "model_transaction_policy { decoupled: true }"
ONE_INSTANCE = "kind: KIND_CPU count: 1 }"


def add_model(repo: Path, model: str, params: dict[str, str] | None = None,
              decoupled: bool = True, source: str = "", instances: int = 1) -> None:
    """Copy ``model``'s config (plus ``params``) and its model.py into ``repo``;
    ``decoupled`` false: a decoupled model's config made non-decoupled; ``source``: the
    folder (of ``model_repository/`` and ``backends/python/``) served under the name
    ``model`` (default: ``model``'s own); ``instances``: its instance group's count (a
    config of one instance)."""
    source = source or model
    config = CONFIGS / source / "config.pbtxt"
    if not config.exists():
        raise ValueError(f"no model {source!r} in {CONFIGS}")
    version = repo / model / "1"
    version.mkdir(parents=True, exist_ok=True)
    text = config.read_text()
    if not decoupled:
        if DECOUPLED not in text:
            raise ValueError(f"model {model!r} is not decoupled")
        text = text.replace(DECOUPLED, "model_transaction_policy { decoupled: false }")
    if instances != 1:
        if ONE_INSTANCE not in text:
            raise ValueError(f"model {model!r} has no instance group of one instance")
        text = text.replace(ONE_INSTANCE, f"kind: KIND_CPU count: {instances} }}")
    text += "".join(_parameter(k, str(v)) for k, v in (params or {}).items())
    with open_private(repo / model / "config.pbtxt") as f:
        f.write(text)
    code = MODEL_CODE / source / "model.py"
    if code.exists():
        with open_private(version / "model.py", "wb") as f:
            f.write(code.read_bytes())


@dataclass
class TritonServer:
    """A tritonserver on loopback ports: ``launch`` starts it, ``wait_ready`` waits for it."""

    name: str
    repo: Path
    backend_dir: Path
    log_path: Path
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    incarnation: int = 0  # started again after a failure this many times
    devices: Devices | None = None  # pinned to these cores / GPUs (None: anywhere)
    host: str = "127.0.0.1"  # where it listens (a container: every interface)
    public: bool = False  # serves clients (the frontend): metadata, config, statistics open
    namespace: ShmNamespace | None = None  # started inside it: its /dev/shm is the cluster's

    @property
    def shm_prefix(self) -> str:
        # Our own prefix, so cleanup after a crash removes this incarnation's regions only.
        again = f"r{self.incarnation}_" if self.incarnation else ""
        return f"dejavu_{self.name}_{self.grpc_port}_{again}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        return [
            str(WHEEL / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={self.backend_dir}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            "--exit-timeout-secs=2",
            "--log-verbose=0",
            *self.restriction_flags(),
        ]

    def restriction_flags(self) -> list[str]:
        apis = ",".join(PUBLIC_RESTRICTED if self.public else INTERNAL_RESTRICTED)
        return [f"--http-restricted-api={apis}:{LOCKED_HTTP}",
                f"--grpc-restricted-protocol={apis}:{LOCKED_GRPC}"]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The stub ignores PYTHONPATH; it runs the python first on PATH, so the
        # venv's bin goes first. It also needs the wheel's libcudart.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = f"{WHEEL_LIBS}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}"
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("UCX_TLS", "tcp,sm")
        if self.devices is not None:
            env.update(self.devices.environment())
        return env

    def launch(self) -> None:
        """Start the process without waiting: several nodes can start side by side."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open_private(self.log_path, "ab") as log:
            enter = [] if self.namespace is None else self.namespace.enter()
            self.process = subprocess.Popen(
                enter + self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # Ctrl-C in a shell must not kill the nodes
                umask=UMASK,
                preexec_fn=None if self.devices is None else self.devices.pin,
            )

    def is_ready(self) -> bool:
        return is_ready(self.http_url)

    def shm_regions(self) -> list[Path]:
        return shm_regions(self.shm_prefix, self.namespace)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(
                    f"tritonserver {self.name} exited with {self.process.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            protect_shm(self.shm_prefix, self.namespace)  # as soon as the stubs make them
            if self.is_ready():
                protect_shm(self.shm_prefix, self.namespace)
                return
            time.sleep(0.2)
        self.stop()
        raise ServerError(
            f"tritonserver {self.name} not ready after {timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_servers([self], timeout_s)


def stop_servers(servers: list[TritonServer], timeout_s: float = 15.0) -> None:
    """Stop several servers side by side (each takes seconds to unload its models)."""
    started = [s.process for s in servers if s.process is not None]
    stop_processes([p.pid for p in started], timeout_s)
    for process in started:
        process.wait(timeout=5)
    for server in servers:
        clean_shm(server.shm_prefix, server.namespace)


def is_ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_processes(pids: list[int], timeout_s: float = 15.0) -> None:
    """SIGTERM all at once, then SIGKILL what is left after ``timeout_s``, and what is left
    of each one's process group (pgid == pid where started with ``start_new_session``): a
    Python-backend stub whose finalize hangs outlives its server, and ignores SIGTERM.
    Never init or this process itself (a state file that names them is not ours to act on)."""
    pids = [pid for pid in pids if pid > 1 and pid not in (os.getpid(), os.getpgrp())]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def proc_stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by its parent, is not)."""
    with contextlib.suppress(ChildProcessError):  # our own child: reap it
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False


def protect_shm(prefix: str, namespace: ShmNamespace | None = None) -> None:
    """Make a node's Python-backend regions its user's alone: the backend creates them 0644
    whatever the umask (boost.interprocess sets the mode after ``shm_open``). In the
    cluster's namespace (``namespace``) no other user sees them anyway."""
    for path in shm_regions(prefix, namespace):
        with contextlib.suppress(OSError):  # gone meanwhile
            path.chmod(0o600)


def clean_shm(prefix: str, namespace: ShmNamespace | None = None) -> None:
    """Remove the Python backend's shared-memory regions a killed node leaves behind: its
    prefix and a uuid. Not a later incarnation's, whose prefix extends this one's (the
    supervisor may have started it already: its stubs would never come up)."""
    for path in shm_regions(prefix, namespace):
        with contextlib.suppress(ValueError):
            uuid.UUID(path.name.removeprefix(prefix))
            path.unlink(missing_ok=True)


def shm_regions(prefix: str, namespace: ShmNamespace | None = None) -> list[Path]:
    """A node's Python-backend regions (``namespace``: its cluster's, else the host's)."""
    return sorted(_shm_dir(namespace).glob(f"{prefix}*"))


def _shm_dir(namespace: ShmNamespace | None) -> Path:
    """Where a node's regions are: its cluster's namespace's /dev/shm, else the host's."""
    return SHM_DIR if namespace is None else namespace.shm_dir
