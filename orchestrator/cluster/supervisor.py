"""The cluster's supervisor: starts lost nodes again; T-stages recover from KV replicas.

``dejavu up`` starts it (``python -m orchestrator.cluster.supervisor --dir DIR``);
``dejavu down`` stops it. It reads the cluster's state file and asks the fault
controller, every ``poll_s``, which nodes it has declared dead, and starts each
again: the same ports and repository under a new incarnation name, so the
controller and the KV transports see a new node. A P-node just serves again
(its prompts in flight ran again elsewhere); with a warm P spare on standby
(``dejavu up --prefill-spares N``) the spare takes its role at once instead
(``assume``: it registers in the lost node's place, the frontends send it that
place's prompts), and a new P spare starts later as for T-stages. For a lost T-stage x > 0 of a
replicating pipeline it waits for the controller's recovery plan and carries
it out (:func:`orchestrator.fault.stage_recovery.recover_stage`). With a warm
spare on standby (``dejavu up --spares N``) the lost stage's role moves to
the spare instead (``assume``: no process start, no model load), the state
file's entries trade places (the spare's now names the stage) and, once the
pipeline has run again for ``spare_delay_s``, a new spare starts where the lost
node was. A spare that
dies on standby is started again too.
A head paused while every stage is alive (a connection between two stages
dropped) has every stage connect to its successor again
(:func:`orchestrator.fault.stage_recovery.repair_links`). A lost stage 0 took
its head and its clients' streams with it: with a spare on standby, the spare
takes its role as it takes any stage's (the survivors drop the requests' KV and
the frontend runs them again from their prompts on the resumed pipeline);
without one, or in a pipeline without replicas (nothing to resume from), the
frontend runs those requests again from their prompts and the supervisor starts
the whole pipeline afresh.

A node's tritonserver that ends is told to the controller at once (its pid
watch, :mod:`orchestrator.cluster.pid_watch`): the failover starts then, not
after the heartbeat timeout.

It also keeps the processes the controller does not watch: a lost controller
is started again on its port (the nodes register again and re-send their acks,
so a stage lost meanwhile is declared dead then and recovered as above), a
lost frontend on its ports, a lost OpenAI API on its port (a warm spare
of it, loaded and waiting, serves at once), and a lost watchdog
(:mod:`orchestrator.cluster.watchdog`), which in turn starts a lost supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import grpc

from orchestrator.cluster.chaos import kill
from orchestrator.cluster.devices import node_devices
from orchestrator.cluster.launcher import (
    OPENAI_STANDBY,
    STATE_FILE,
    Controller,
    OpenAIApi,
    connect_pipeline,
    promote_standby,
    read_state,
)
from orchestrator.cluster.pid_watch import PidWatch
from orchestrator.cluster.shm_namespace import ShmNamespace
from orchestrator.cluster.topology import write_node_repo
from orchestrator.cluster.tritonserver import ServerError, TritonServer, alive, clean_shm
from orchestrator.cluster.watchdog import (
    MODULES,
    keep,
    keeper_arguments,
    stopping,
    write_atomic,
)
from orchestrator.control.auth import load_secret
from orchestrator.control.client import ControlClient
from orchestrator.fault.client import query_status
from orchestrator.fault.rpc import Stub
from orchestrator.fault.stage_recovery import recover_stage, repair_links
from orchestrator.serving.config import NodeConfig, Role

log = logging.getLogger("dejavu.supervisor")
PLAN_POLL_S = 0.02  # the head is paused meanwhile: ask often
STANDBY_EVERY_S = 5.0


class Supervisor:
    def __init__(self, run_dir: Path, poll_s: float = 0.2, ready_timeout_s: float = 180.0,
                 call_timeout_s: float = 60.0, spare_delay_s: float = 10.0) -> None:
        """``spare_delay_s``: how long after a takeover the new spare starts. Its start (a
        tritonserver, its stubs, a model load) takes the cores the resumed pipeline runs on
        when they share a machine: started at once here, it overlapped the first resumed
        steps (a 2.6 s pause for clients, of which detection and repair took 0.9 s)."""
        self.run_dir, self.poll_s = run_dir, poll_s
        self.spare_delay_s, self.spares_after = spare_delay_s, 0.0
        self.wake = threading.Event()  # a node was reported lost: poll now
        self.ready_timeout_s, self.call_timeout_s = ready_timeout_s, call_timeout_s
        self.given_up: set[str] = set()  # pipelines that cannot be recovered
        self.children: list[subprocess.Popen] = []  # the nodes it started, reaped when they end
        self.link_check_s, self.next_link_check = 1.0, 0.0
        self.paused_since: dict[str, float] = {}  # pipeline -> first seen paused, all alive
        self.watchdog: subprocess.Popen | None = None  # the one it started last
        self.next_standby = 0.0  # when an OpenAI API spare may start next
        state = read_state(run_dir)
        self.secret = load_secret(state["secret_file"])
        self.control = ControlClient(self.secret, call_timeout_s)
        self._stub: Stub | None = None  # to the controller, kept: it is asked every poll

    def controller_stub(self, address: str) -> Stub:
        """The kept channel to the controller at ``address`` (a new one if it moved)."""
        if self._stub is None or self._stub.address != address:
            if self._stub is not None:
                self._stub.close()
            self._stub = Stub(address, self.secret)
        return self._stub

    def run(self) -> None:
        # A node's end is told the controller at once, and wakes this loop to act on it.
        watch = PidWatch(self.run_dir, self.secret, on_lost=self.wake.set)
        watch.start()
        try:
            self.serve()
        finally:
            watch.stop.set()

    def serve(self) -> None:
        while not stopping(self.run_dir):
            self.wake.wait(self.poll_s)
            self.wake.clear()
            self.children = [p for p in self.children if p.poll() is None]
            try:
                state = read_state(self.run_dir)
                self.keep_processes(state)
                view = query_status(self.controller_stub(state["controller"]["address"]))
            except grpc.RpcError:
                continue  # the controller is away: failures wait until it is back
            except FileNotFoundError:
                return  # the cluster is down
            for name, pipeline in view["pipelines"].items():
                if pipeline["failed"] and name not in self.given_up:
                    self.recover(state, name)
            self.replenish(state)
            if time.monotonic() >= self.next_link_check:
                self.next_link_check = time.monotonic() + self.link_check_s
                self.check_links(state, view)

    def keep_processes(self, state: dict) -> None:
        """Start the watchdog, the controller, the OpenAI API and the frontend again if they
        are gone (the nodes come back through the controller's view: :meth:`recover`)."""
        self.watchdog = keep(self.run_dir, "watchdog", self.watchdog)
        if not alive(state["controller"]["pid"]) and not stopping(self.run_dir):
            self.start_again(state, "controller", Controller.described(state))
        if state.get("openai") and not stopping(self.run_dir):
            self.keep_openai(state)
        for node in state["nodes"]:
            if node["role"] == "frontend" and not alive(node["pid"]) and not stopping(
                    self.run_dir):
                log.warning("the frontend is gone (pid %s); starting it again", node["pid"])
                try:
                    self.ready(self.launch(state, node), node)
                except ServerError:
                    log.exception("the frontend did not start; trying again")

    def keep_openai(self, state: dict) -> None:
        """A lost OpenAI API: its warm spare serves in its place (no start, no imports: a
        fraction of a second), or, if none is ready, a new one starts; then a new spare
        starts, not waited for."""
        api, fifo = state["openai"], self.run_dir / OPENAI_STANDBY
        if not alive(api["pid"]):
            if api.get("standby_pid") and promote_standby(fifo):
                log.warning("the openai is gone (pid %s); its standby (pid %s) serves",
                            api["pid"], api["standby_pid"])
                api["pid"], api["standby_pid"] = api["standby_pid"], None
                self.write_state(state)
            else:
                self.start_again(state, "openai", OpenAIApi.described(state))
        if (not (api.get("standby_pid") and alive(api["standby_pid"]))
                and time.monotonic() >= self.next_standby):
            # At most one start per STANDBY_EVERY_S: a spare that cannot start must not
            # become a loop of interpreters loading.
            self.next_standby = time.monotonic() + STANDBY_EVERY_S
            if not fifo.exists():
                os.mkfifo(fifo, 0o600)
            standby = OpenAIApi.described(state).start_standby(fifo)
            self.children.append(standby)
            api["standby_pid"] = standby.pid
            self.write_state(state)

    def start_again(self, state: dict, key: str, helper: Controller | OpenAIApi) -> None:
        """Start the lost ``state[key]`` process (the controller, the OpenAI API) and record
        its new pid; one that fails to start is tried again at the next poll."""
        log.warning("the %s is gone (pid %s); starting it again", key, state[key]["pid"])
        try:
            helper.start()
        except ServerError:
            log.exception("the %s did not start; trying again", key)
            return
        except BaseException:  # stopped meanwhile: leave none behind
            helper.stop()
            raise
        self.children.append(helper.process)
        state[key]["pid"] = helper.pid
        self.write_state(state)

    def check_links(self, state: dict, view: dict) -> None:
        """A head paused for a repair while the controller sees every stage alive (for
        longer than it takes to declare one dead): a connection dropped; repair it."""
        grace_s = float(view["timeout_s"]) + 2 * self.link_check_s
        alive = {(n["pipeline"], n["stage"]) for n in view["nodes"] if n["alive"]}
        for index in sorted({n["pipeline"] for n in state["nodes"] if n["role"] == "decode"}):
            stages = _stages(state, index)
            name, urls = f"decode{index}", [n["grpc"] for n in stages]
            # A controller started again does not know yet of a stage that died meanwhile.
            all_alive = all((name, stage) in alive for stage in range(len(urls)))
            if not _replicates(stages) or name in self.given_up or not all_alive:
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
                    kept = repair_links(self.call, urls)
                    self.record(state, name, "links repaired", requests_kept=kept)
                except Exception:
                    log.exception("%s: repairing its connections failed; trying again",
                                  name)
                self.paused_since.pop(name, None)

    def recover(self, state: dict, name: str) -> None:
        """Start ``name``'s lost nodes again; a failure to do so is tried again at the next
        poll. A failed recovery starts the whole pipeline afresh."""
        try:
            if name.startswith("prefill"):
                lost = _prefill_node(state, name)
                if self.take_over(state, lost):  # a warm P spare serves in its place
                    self.close_repair(state, name, [lost])
                    self.record(state, name, "taken over")
                else:
                    self.restart_nodes(state, name, [lost])
                return
            index = int(name.removeprefix("decode"))
            plan = self.replace(state, name, index)
        except Exception:
            log.exception("%s: starting its lost nodes failed; trying again", name)
            return
        if plan is None:
            return
        try:
            kept = recover_stage(self.call, [n["grpc"] for n in _stages(state, index)], plan)
            self.record(state, name, "recomputed" if plan["recompute"] else "resumed",
                        stages=plan["failed"], requests_kept=len(kept))
        except Exception:
            # Its head would hold the requests until its recover timeout (minutes): start
            # the pipeline afresh instead, and the frontend runs them again elsewhere now.
            log.exception("%s: recovery failed; starting the whole pipeline again", name)
            try:
                self.restart_nodes(state, name, _stages(state, index))
            except Exception:
                log.exception("%s: starting it afresh failed too; giving it up", name)
                self.given_up.add(name)

    def replace(self, state: dict, name: str, index: int) -> dict | None:
        """Start every lost stage again, including those declared while others restart;
        the controller's plan once it covers them all. None if the whole pipeline was
        started afresh instead (stage 0 lost, or no replicas)."""
        controller = state["controller"]["address"]
        stages = _stages(state, index)
        restarted: set[int] = set()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            view = query_status(self.controller_stub(controller))
            failed = set(view["pipelines"][name]["failed"])
            # A spare takes a lost head's place like any stage's; without one, its clients'
            # requests rerun anyway, and the whole pipeline starts afresh.
            if (0 in failed - restarted and not _spare_ready(state, Role.SPARE)
                    or not _replicates(stages)):
                log.warning("%s: stages %s lost, %s; starting the whole pipeline again",
                            name, sorted(failed), "with the head" if 0 in failed else
                            "no replicas to resume from")
                self.restart_nodes(state, name, stages)
                return None
            for x in sorted(failed - restarted):
                if not self.take_over(state, stages[x]):
                    log.warning("%s: stage %d lost; starting it again", name, x)
                    self.ready(self.launch(state, stages[x]), stages[x])
                restarted.add(x)
            plan = self.plan(controller, name)
            if plan is not None and set(plan["failed"]) == failed:
                return plan
            time.sleep(PLAN_POLL_S)
        raise TimeoutError(f"no recovery plan for {name} in {self.ready_timeout_s} s")

    def take_over(self, state: dict, lost: dict) -> bool:
        """Move the lost node's role (a T-stage, or a P-node) to a warm spare of its kind,
        if one is on standby: the two state file entries trade places (the spare's names
        the role from now on, the lost one's a spare to start again). False if no spare
        could take it."""
        kind = Role.SPARE if lost["role"] == Role.DECODE else Role.PREFILL_SPARE
        model = "decode" if kind is Role.SPARE else "prefill"
        place = [str(lost["pipeline"]).encode()]
        if kind is Role.SPARE:
            place.append(str(lost["stage"]).encode())
        for spare in [n for n in state["nodes"] if n["role"] == kind and n.get("pid")]:
            try:
                self.control.call(spare["grpc"], "assume", place, model=model)
            except Exception:
                log.exception("%s could not take over %s; stopping it", spare["name"],
                              lost["name"])
                kill(spare, signal.SIGKILL)
                spare["pid"] = None  # started again by replenish
                continue
            log.warning("%s took over %s's role (pipeline %d, stage %s)", spare["name"],
                        lost["name"], lost["pipeline"], lost["stage"])
            kill(lost, signal.SIGKILL)  # declared dead: make sure (a spare starts on its ports)
            self.spares_after = time.monotonic() + self.spare_delay_s
            role = {k: lost["config"][k] for k in ("role", "pipeline", "stage")}
            taken = {**spare, **{k: lost[k] for k in ("role", "pipeline", "stage")},
                     "name": lost["name"], "config": spare["config"] | role}
            port = lost["grpc"].split(":")[1]
            standby = {**lost, "name": spare["name"], "role": kind.value, "pipeline": None,
                       "stage": None, "pid": None,
                       "log": str(Path(lost["log"]).with_name(f"{spare['name']}-{port}.log")),
                       "config": lost["config"] | {"role": kind.value, "stage": 0}}
            lost.clear()
            lost.update(taken)
            spare.clear()
            spare.update(standby)
            self.write_state(state)
            return True
        return False

    def replenish(self, state: dict) -> None:
        """Start every spare that is not running (it took over a stage, or died), once the
        last takeover is ``spare_delay_s`` old."""
        if time.monotonic() < self.spares_after:
            return
        for spare in state["nodes"]:
            if (Role(spare["role"]).spare and not _running(spare)
                    and not stopping(self.run_dir)):
                log.warning("starting spare %s", spare["name"])
                try:
                    self.ready(self.launch(state, spare), spare)
                except Exception:
                    log.exception("spare %s did not start; trying again", spare["name"])

    def restart_nodes(self, state: dict, name: str, nodes: list[dict]) -> None:
        """Start a P-node, or a token pipeline's every stage, afresh (what a lost head or a
        pipeline without replicas comes to: the frontend ran its requests again)."""
        for node in nodes:  # a pipeline's survivors too: it is gone (their stubs with them)
            kill(node, signal.SIGKILL)
        servers = [self.launch(state, node) for node in nodes]
        for server, node in zip(servers, nodes, strict=True):
            self.ready(server, node)
        if len(nodes) > 1:
            connect_pipeline(self.call, [n["grpc"] for n in nodes], _replicates(nodes))
        self.close_repair(state, name, nodes)
        log.warning("%s: started afresh (incarnation %d)", name, nodes[0]["incarnation"])
        self.record(state, name, "started afresh")

    def close_repair(self, state: dict, name: str, nodes: list[dict]) -> None:
        """Once the old nodes are declared dead and the new ones (``nodes``) hold every
        slot, the controller has a plan with nothing to restore: the new nodes close it."""
        controller = state["controller"]["address"]
        deadline = time.monotonic() + self.ready_timeout_s
        while (plan := self.plan(controller, name)) is None or len(plan["failed"]) < len(nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller did not take {name}'s new nodes")
            time.sleep(self.poll_s)
        for node in nodes:
            self.controller_stub(controller).call(
                "Recovered", {"node_id": node["config"]["name"], "epoch": plan["epoch"]}, 2.0)

    def launch(self, state: dict, node: dict) -> TritonServer:
        """A lost node's tritonserver again, as a new incarnation (same ports and repo)."""
        incarnation = int(node.get("incarnation", 0)) + 1
        config = replace(NodeConfig.from_dict(node["config"]),
                         name=f"{node['name']}-{node['grpc'].split(':')[1]}-r{incarnation}")
        repo = Path(node["repo"])
        write_node_repo(repo, config)
        ports = (int(node[k].split(":")[1]) for k in ("http", "grpc", "metrics"))
        server = TritonServer(node["name"], repo, Path(state["backends"]), Path(node["log"]),
                              *ports, incarnation=incarnation, devices=node_devices(config.devices),
                              public=config.role is Role.FRONTEND,
                              namespace=ShmNamespace.from_state(state))
        clean_shm(node["shm_prefix"], server.namespace)  # a node that died left its regions
        server.launch()
        self.children.append(server.process)
        # Recorded at once: `dejavu down` stops it even if it is never ready.
        node.update(config=asdict(config), incarnation=incarnation, pid=server.process.pid,
                    shm_prefix=server.shm_prefix)
        self.write_state(state)
        return server

    def ready(self, server: TritonServer, node: dict) -> None:
        """Wait for a launched node."""
        server.wait_ready(self.ready_timeout_s)
        log.warning("%s is back (pid %d, incarnation %d)", node["name"], server.process.pid,
                    server.incarnation)

    def record(self, state: dict, pipeline: str, outcome: str, **details) -> None:
        """A repair done, in the state file: what tests, benches and operators read."""
        state.setdefault("repairs", []).append({"pipeline": pipeline, "outcome": outcome,
                                                "at": time.time(), **details})
        self.write_state(state)

    def write_state(self, state: dict) -> None:
        write_atomic(self.run_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")

    def plan(self, controller: str, pipeline: str) -> dict | None:
        return self.controller_stub(controller).call("Plan", {"pipeline": pipeline}, 2.0)["plan"]

    def call(self, url: str, op: str, args: list[bytes]) -> bytes:
        return self.control.call(url, op, args)


def _prefill_node(state: dict, name: str) -> dict:
    index = int(name.removeprefix("prefill"))
    return next(n for n in state["nodes"] if n["role"] == "prefill" and n["pipeline"] == index)


def _spare_ready(state: dict, kind: Role) -> bool:
    """Whether a warm spare of ``kind`` is on standby (loaded: its process is running)."""
    return any(n["role"] == kind and _running(n) for n in state["nodes"])


def _running(node: dict) -> bool:
    """Whether the state file's ``node`` has a process, and it is running."""
    return bool(node.get("pid") and alive(node["pid"]))


def _replicates(stages: list[dict]) -> bool:
    """Whether a token pipeline's stages keep KV replicas (every stage has the same mode)."""
    return NodeConfig.from_dict(stages[0]["config"]).replicates


def _stages(state: dict, pipeline: int) -> list[dict]:
    """The state file's nodes of one token pipeline, stage 0 first."""
    nodes = [n for n in state["nodes"] if n["role"] == "decode" and n["pipeline"] == pipeline]
    return sorted(nodes, key=lambda n: n["stage"])


def main(argv: list[str] | None = None) -> int:
    args = keeper_arguments(MODULES["supervisor"], __doc__.splitlines()[0], 0.2, argv)
    supervisor = Supervisor(args.dir.resolve(), args.poll_s)
    print(f"supervisor watching {args.dir}", flush=True)
    supervisor.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
