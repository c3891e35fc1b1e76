"""The cluster's supervisor: restarts lost T-nodes and has them recovered from KV replicas.

``dejavu up`` starts it (``python -m orchestrator.cluster.supervisor --dir DIR``)
when some token pipeline replicates its KV; ``dejavu down`` stops it. It reads
the cluster's state file and asks the fault controller, every ``poll_s``, which
stages it has declared dead. For a lost stage x > 0 it starts the node's
tritonserver again (same ports and repository, a new incarnation name, so the
controller and the KV transports see a new node), waits for the controller's
recovery plan, and carries it out (:func:`orchestrator.fault.stage_recovery.recover_stage`).
A lost stage 0 took its head and its clients' streams with it: the frontend
runs those requests again on another pipeline, and the supervisor leaves that
pipeline down (it says so in its log).
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
from orchestrator.fault.stage_recovery import recover_stage

log = logging.getLogger("dejavu.supervisor")


class Supervisor:
    def __init__(self, run_dir: Path, poll_s: float = 0.2, ready_timeout_s: float = 180.0,
                 call_timeout_s: float = 60.0) -> None:
        self.run_dir, self.poll_s = run_dir, poll_s
        self.ready_timeout_s, self.call_timeout_s = ready_timeout_s, call_timeout_s
        self.given_up: set[str] = set()  # pipelines that cannot be recovered
        self.children: list[subprocess.Popen] = []  # the nodes it started, reaped when they end
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
                    self.recover(state, name, pipeline)

    def recover(self, state: dict, name: str, pipeline: dict) -> None:
        index, failed = int(name.removeprefix("decode")), pipeline["failed"]
        if 0 in failed:
            log.error("%s: stage 0 is lost with its head; the pipeline stays down (the "
                      "frontend runs its requests again elsewhere)", name)
            self.given_up.add(name)
            return
        log.warning("%s: stages %s lost; starting them again", name, failed)
        try:
            for x in failed:
                self.restart(state, index, x)
            plan = self.wait_for_plan(state["controller"]["address"], name, failed)
            urls = [n["grpc"] for n in _stages(state, index)]
            recover_stage(self.call, urls, plan)
        except Exception:
            log.exception("%s: recovery of stages %s failed; its head gives up at its "
                          "recover timeout", name, failed)
            self.given_up.add(name)

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

    def wait_for_plan(self, controller: str, pipeline: str, failed: list[int]) -> dict:
        stub = Stub(controller)
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while time.monotonic() < deadline:
                with_plan = stub.call("Plan", {"pipeline": pipeline}, 2.0)["plan"]
                if with_plan is not None and set(failed) <= set(with_plan["failed"]):
                    return with_plan
                time.sleep(self.poll_s)
        finally:
            stub.close()
        raise TimeoutError(f"no recovery plan for {pipeline} in {self.ready_timeout_s} s")

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
