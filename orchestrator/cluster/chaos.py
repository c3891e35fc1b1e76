"""Fault injection on a local cluster: ``dejavu chaos list``, ``kill NODE``, ``drop NODE``.

Reads the state file that ``dejavu up`` wrote. ``kill`` signals a node's whole
process group (the tritonserver and its Python-backend stubs: the launcher
starts each node in a session of its own), waits until it is gone and removes
the shared-memory regions a killed node leaves in /dev/shm. ``controller``
names the fault controller, ``openai`` the OpenAI-compatible API, ``supervisor``
and ``watchdog`` the two that start lost processes again. ``drop`` makes a
T-node of a replicating pipeline lose its transport connection to the next
stage (the process lives on).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.cluster.launcher import STATE_FILE, read_state
from orchestrator.cluster.shm_namespace import ShmNamespace
from orchestrator.cluster.tritonserver import alive, clean_shm
from orchestrator.cluster.watchdog import read_pid
from orchestrator.control.auth import load_secret

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


def targets(state: dict, run_dir: str | Path) -> dict[str, dict]:
    """Every process that can be killed, by name: the nodes, the controller, the OpenAI API,
    the supervisor and its watchdog."""
    # A node's regions are in its cluster's namespace (ShmNamespace.from_state reads it).
    found = {node["name"]: {**node, "namespace": state.get("namespace")}
             for node in state["nodes"]}
    for role in ("controller", "openai"):
        if (state.get(role) or {}).get("pid"):
            found[role] = {"name": role, "role": role, **state[role]}
    for role in ("supervisor", "watchdog"):
        pid = read_pid(Path(run_dir), role)
        if pid is not None:
            found[role] = {"name": role, "role": role, "pid": pid}
    return found


def kill(target: dict, sig: signal.Signals, timeout_s: float = 15.0) -> None:
    """Signal ``target``'s process group; raise TimeoutError if it outlives ``timeout_s``."""
    pid = target["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # pgid == pid: started with start_new_session
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target['name']} (pid {pid}) still alive {timeout_s:.0f} s "
                               f"after {sig.name}")
        time.sleep(0.05)
    if target.get("shm_prefix"):
        clean_shm(target["shm_prefix"], ShmNamespace.from_state(target))


def drop(target: dict, secret_file: str) -> int:
    from tritonclient.utils import InferenceServerException

    from orchestrator.control.client import ControlClient  # tritonclient: only where needed
    from orchestrator.control.errors import ControlError

    if target["role"] != "decode":
        print(f"dejavu chaos drop: {target['name']} is a {target['role']} node; only T-nodes "
              "have a connection to a next stage", file=sys.stderr)
        return 2
    control = ControlClient(load_secret(secret_file), 10.0)
    try:
        control.call(target["grpc"], "drop_link")
    except (InferenceServerException, ControlError) as exc:
        print(f"dejavu chaos drop: {exc}", file=sys.stderr)
        return 1
    finally:
        control.close()
    print(f"dropped {target['name']}'s connection to its next stage")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu chaos", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["list", "kill", "drop"])
    parser.add_argument("node", nargs="?", help="a node's name (see list); kill: or "
                        "controller, openai, supervisor, watchdog")
    parser.add_argument("--signal", choices=list(SIGNALS), default="KILL")
    parser.add_argument("--dir", default="runs/local", help="the cluster's folder")
    args = parser.parse_args(argv)
    try:
        found = targets(read_state(args.dir), args.dir)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.action == "list":
        for name, t in found.items():
            state = "alive" if t.get("pid") and alive(t["pid"]) else "gone"
            print(f"{name:<12} {t['role']:<10} pid {t.get('pid')}  {state}")
        return 0
    if args.node not in found:
        print(f"dejavu chaos {args.action}: no node {args.node!r} in {args.dir}/{STATE_FILE}; "
              f"choose from {', '.join(found)}", file=sys.stderr)
        return 2
    if args.action == "drop":
        return drop(found[args.node], read_state(args.dir)["secret_file"])
    try:
        kill(found[args.node], SIGNALS[args.signal])
    except TimeoutError as exc:
        print(f"dejavu chaos kill: {exc}", file=sys.stderr)
        return 1
    print(f"killed {args.node} (pid {found[args.node]['pid']}, SIG{args.signal})")
    return 0
