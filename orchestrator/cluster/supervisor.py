"""The cluster's supervisor: restarts lost T-nodes and has them recovered from KV replicas.

``dejavu up`` starts it (``python -m orchestrator.cluster.supervisor --dir DIR``)
when some token pipeline replicates its KV; ``dejavu down`` stops it. It reads
the cluster's state file and asks the fault controller, every ``poll_s``, which
stages it has declared dead. For a lost stage x > 0 it starts the node's
tritonserver again (same ports and repository, a new incarnation name, so the
controller and the KV transports see a new node), waits for the controller's
recovery plan, and carries it out (:func:`orchestrator.fault.stage_recovery.recover_stage`).
A head paused while every stage is alive (a connection between two stages
dropped) has every stage connect to its successor again
(:func:`orchestrator.fault.stage_recovery.repair_links`). A lost stage 0 took
its head and its clients' streams with it: the frontend runs those requests
again on another pipeline, and the supervisor leaves that pipeline down (it
says so in its log).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc

from orchestrator.cluster.launcher import STATE_FILE, read_state, write_node_repo
from orchestrator.cluster.tritonserver import TritonServer, clean_shm
from orchestrator.fault.client import query_status
from orchestrator.fault.rpc import Stub
from orchestrator.fault.stage_recovery import recover_stage, repair_links

log = logging.getLogger("dejavu.supervisor")


class Supervisor:
    def __init__(self, run_dir: Path, poll_s: float = 0.2, ready_timeout_s: float = 180.0,
                 call_timeout_s: float = 60.0) -> None:
        self.run_dir, self.poll_s = run_dir, poll_s
        self.ready_timeout_s, self.call_timeout_s = ready_timeout_s, call_timeout_s
        self.given_up: set[str] = set()  # pipelines that cannot be recovered
        self.children: list[subprocess.Popen] = []  # the nodes it started, reaped when they end
        self.link_check_s, self.next_link_check = 1.0, 0.0
        self.paused_since: dict[str, float] = {}  # pipeline -> first seen paused, all alive
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            self.children = [p for p in self.children if p.poll() is None]
            try:
                state = read_state(self.run_dir)
                view = query_status(state["controller"]["address"])
            except grpc.RpcError:
                continue  # the controller is away: failures wait until it is back
            except FileNotFoundError:
                return  # the cluster is down
            for name, pipeline in view["pipelines"].items():
                if pipeline["failed"] and name.startswith("decode") and name not in self.given_up:
                    self.recover(state, name)
            if time.monotonic() >= self.next_link_check:
                self.next_link_check = time.monotonic() + self.link_check_s
                self.check_links(state, view)

    def check_links(self, state: dict, view: dict) -> None:
        """A head paused for a repair while the controller sees every stage alive (for
        longer than it takes to declare one dead): a connection dropped; repair it."""
        grace_s = float(view["timeout_s"]) + 2 * self.link_check_s
        alive = {(n["pipeline"], n["stage"]) for n in view["nodes"] if n["alive"]}
        for index in sorted({n["pipeline"] for n in state["nodes"] if n["role"] == "decode"}):
            name, urls = f"decode{index}", [n["grpc"] for n in _stages(state, index)]
            # A controller started again does not know yet of a stage that died meanwhile.
            all_alive = all((name, stage) in alive for stage in range(len(urls)))
            if len(urls) < 2 or name in self.given_up or not all_alive:
                self.paused_since.pop(name, None)
                continue
            try:
                fault = self.call(urls[0], "fault", []).decode()
            except Exception:  # its head is gone: the controller will say so
                continue
            if not fault:
                self.paused_since.pop(name, None)
            elif time.monotonic() - self.paused_since.setdefault(name, time.monotonic()) > grace_s:
                log.warning("%s: every stage alive but the head waits for a repair (%s); "
                            "connecting the stages again", name, fault)
                try:
                    repair_links(self.call, urls)
                except Exception:
                    log.exception("%s: repairing its connections failed; trying again",
                                  name)
                self.paused_since.pop(name, None)

    def recover(self, state: dict, name: str) -> None:
        index = int(name.removeprefix("decode"))
        try:
            plan = self.replace(state, name, index)
            if plan is None:
                return
            recover_stage(self.call, [n["grpc"] for n in _stages(state, index)], plan)
        except Exception:
            log.exception("%s: recovery failed; its head gives up at its recover timeout",
                          name)
            self.given_up.add(name)

    def replace(self, state: dict, name: str, index: int) -> dict | None:
        """Start every lost stage again, including those declared while others restart,
        until the controller's plan covers them all; None if stage 0 is lost."""
        controller = state["controller"]["address"]
        restarted: set[int] = set()
        stub = Stub(controller)
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while time.monotonic() < deadline:
                failed = set(query_status(controller)["pipelines"][name]["failed"])
                if 0 in failed:
                    log.error("%s: stage 0 is lost with its head; the pipeline stays down "
                              "(the frontend runs its requests again elsewhere)", name)
                    self.given_up.add(name)
                    return None
                for x in sorted(failed - restarted):
                    log.warning("%s: stage %d lost; starting it again", name, x)
                    self.restart(state, index, x)
                    restarted.add(x)
                plan = stub.call("Plan", {"pipeline": name}, 2.0)["plan"]
                if plan is not None and set(plan["failed"]) == failed:
                    return plan
                time.sleep(self.poll_s)
        finally:
            stub.close()
        raise TimeoutError(f"no recovery plan for {name} in {self.ready_timeout_s} s")

    def restart(self, state: dict, pipeline: int, stage: int) -> None:
        """The lost node's tritonserver again, as a new incarnation; updates the state file."""
        node = _stages(state, pipeline)[stage]
        incarnation = int(node.get("incarnation", 0)) + 1
        params = node["params"] | {"name": f"{node['name']}-{node['grpc'].split(':')[1]}"
                                           f"-r{incarnation}"}
        repo = Path(node["repo"])
        write_node_repo(repo, "decode", params)
        ports = (int(node[k].split(":")[1]) for k in ("http", "grpc", "metrics"))
        server = TritonServer(node["name"], repo, Path(state["backends"]), Path(node["log"]),
                              *ports, incarnation=incarnation)
        clean_shm(node["shm_prefix"])  # a node that died on its own left its regions
        server.launch()
        self.children.append(server.process)
        server.wait_ready(self.ready_timeout_s)
        node.update(pid=server.process.pid, params=params, incarnation=incarnation,
                    shm_prefix=server.shm_prefix)
        path = self.run_dir / STATE_FILE
        path.with_suffix(".tmp").write_text(json.dumps(state, indent=2) + "\n")
        path.with_suffix(".tmp").replace(path)
        log.warning("%s is back (pid %d, incarnation %d)", node["name"], server.process.pid,
                    incarnation)

    def call(self, url: str, op: str, args: list[bytes]) -> bytes:
        from orchestrator.serving.frontend import control  # tritonclient: only where needed

        return control(url, op, self.call_timeout_s, peers=args or None)


def _stages(state: dict, pipeline: int) -> list[dict]:
    """The state file's nodes of one token pipeline, stage 0 first."""
    nodes = [n for n in state["nodes"] if n["role"] == "decode" and n["pipeline"] == pipeline]
    return sorted(nodes, key=lambda n: n["stage"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.cluster.supervisor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="the cluster's folder")
    parser.add_argument("--poll-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    supervisor = Supervisor(args.dir, args.poll_s)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stopping.set())
    print(f"supervisor watching {args.dir}", flush=True)
    supervisor.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
