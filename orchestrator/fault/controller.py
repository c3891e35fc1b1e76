"""The controller: a process of its own that watches the token pipelines (DejaVu §4.3).

Nodes register (role, pipeline, stage, address) and
heartbeat. A node whose transport lost its connection to another stage says
so (``Suspect``); the controller probes that node's address at once and
declares it dead if nothing listens there any more, so detection need not
wait for the heartbeat timeout (a dropped connection between live nodes is
not a death: the address still answers). Whoever sees a node's process end
says so too (``Lost``): the supervisor, whose pid watch reaps it, and the
node's own stub or token service when the other one dies; that node is dead
at once. A stage's replica holder (stage
(x+1)%D) acks ``(x, j, t)`` once it holds x's KV of microbatch j through
step t. A node silent for ``timeout_s`` is declared dead and its pipeline
paused; when a replacement registers for the lost stage the controller
issues a *recovery plan*: who restores whom (steps 1 and 2), and per
microbatch the step to redo, from the acks (steps 3 and 4).

State lives in memory only. After a controller restart, live nodes re-register
(``rejoin``) and re-send their acks (see ``client``); a stage of a pipeline
that ran before (one of its nodes rejoined) that never re-registers within
``timeout_s`` is declared dead then. So a failure during the controller's
absence is detected when it returns.

Run: ``python -m orchestrator.fault.controller --port 0`` prints the bound address.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass, field

import grpc

from orchestrator.control.auth import ENV, load_secret
from orchestrator.fault.rpc import RequestError, service_handler
from orchestrator.pipeline import DEAD_AFTER_S

log = logging.getLogger("dejavu.fault.controller")

ROLES = ("token", "prompt", "mixed")


@dataclass
class Node:
    node_id: str
    role: str
    pipeline: str
    stage: int
    depth: int
    address: str
    last_seen: float
    alive: bool = True
    last_beat: int = 0  # the largest heartbeat number it sent


@dataclass
class Pipeline:
    depth: int
    first_seen: float
    rejoined: bool = False  # a node registered again (this controller was restarted)
    epoch: int = 0
    failed: set[int] = field(default_factory=set)  # stages lost and not yet recovered
    plan: dict | None = None
    recovered: set[str] = field(default_factory=set)  # nodes done with ``plan``
    acks: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, microbatch) -> step
    slots: dict[int, str] = field(default_factory=dict)  # stage -> node id

    @property
    def state(self) -> str:
        if not self.failed:
            return "serving"
        return "recovering" if self.plan else "paused"


class ControllerState:
    """The controller's logic, apart from gRPC, with an injectable clock for unit tests."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[str], bool] | None = None) -> None:
        """``probe(address)``: whether a node's address still takes connections (default:
        a TCP connect, see :func:`listening`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.clock = clock
        self.probe = probe or listening
        self.nodes: dict[str, Node] = {}
        self.pipelines: dict[str, Pipeline] = {}
        # Nodes whose processes ended, in the order heard: heartbeats hand them on, so a
        # T-node frees a KV slot that a lost P-node would have written at once.
        self.ended: list[str] = []
        self.lock = threading.Lock()

    # -- node lifecycle ------------------------------------------------------

    def register(self, req: dict) -> dict:
        node_id, pipeline_name = str(req["node_id"]), str(req["pipeline"])
        stage, depth, role = int(req["stage"]), int(req["depth"]), str(req.get("role", "token"))
        if role not in ROLES:
            raise RequestError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
        if not 0 <= stage < depth:
            raise RequestError(f"stage {stage} outside a pipeline of depth {depth}")
        now = self.clock()
        with self.lock:
            pipeline = self.pipelines.setdefault(pipeline_name, Pipeline(depth, now))
            if depth != pipeline.depth:
                raise RequestError(
                    f"pipeline {pipeline_name!r} has depth {pipeline.depth}, node says {depth}"
                )
            holder = self.nodes.get(pipeline.slots.get(stage, ""))
            if holder is not None and holder.alive and holder.node_id != node_id:
                raise RequestError(
                    f"stage {stage} of {pipeline_name!r} is held by live node {holder.node_id!r}",
                    grpc.StatusCode.ALREADY_EXISTS,
                )
            known = self.nodes.get(node_id)
            if known is not None and not known.alive:
                raise RequestError(
                    f"node {node_id!r} was declared dead; register under a new id",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            self.nodes[node_id] = Node(
                node_id, role, pipeline_name, stage, depth,
                str(req.get("address", "")), now,
                last_beat=0 if known is None else known.last_beat,  # numbers go on growing
            )
            pipeline.slots[stage] = node_id
            pipeline.rejoined |= bool(req.get("rejoin"))
            if stage in pipeline.failed:
                log.info("replacement %s registered for stage %d of %s", node_id, stage,
                         pipeline_name)
            self._maybe_plan(pipeline_name, pipeline)
            return {"epoch": pipeline.epoch, "state": pipeline.state}

    def heartbeat(self, req: dict) -> dict:
        """``seq``: the node's heartbeat number, larger than its last (a replayed beat must
        not keep a dead node alive). ``ended_seen``: how many of :attr:`ended` the node has;
        the reply's ``ended`` are the rest."""
        node, seq = self._node(str(req["node_id"])), int(req["seq"])
        with self.lock:
            if seq <= node.last_beat:
                raise RequestError(f"heartbeat {seq} of {node.node_id!r} repeats or precedes "
                                   f"{node.last_beat}", grpc.StatusCode.PERMISSION_DENIED)
            node.last_beat = seq
            node.last_seen = self.clock()
            pipeline = self.pipelines[node.pipeline]
            seen = int(req.get("ended_seen", 0))
            seen = 0 if seen > len(self.ended) else seen  # a controller started again
            return {"epoch": pipeline.epoch, "state": pipeline.state,
                    "ended": self.ended[seen:], "ended_seen": len(self.ended)}

    def ack(self, req: dict) -> dict:
        """``acks``: a list of [source stage, microbatch, step] held by the calling node."""
        node = self._node(str(req["node_id"]))
        with self.lock:
            pipeline = self.pipelines[node.pipeline]
            for stage, microbatch, step in req["acks"]:
                if not 0 <= int(stage) < pipeline.depth:
                    raise RequestError(f"ack for stage {stage} of depth {pipeline.depth}")
                key = (int(stage), int(microbatch))
                pipeline.acks[key] = max(pipeline.acks.get(key, -1), int(step))
        return {}

    def _node(self, node_id: str) -> Node:
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None:
                raise RequestError(f"unknown node {node_id!r}", grpc.StatusCode.NOT_FOUND)
            if not node.alive:
                raise RequestError(
                    f"node {node_id!r} was declared dead", grpc.StatusCode.FAILED_PRECONDITION
                )
            return node

    # -- failure detection -----------------------------------------------------

    def suspect(self, req: dict) -> dict:
        """A node's transport lost stage ``stage`` of its pipeline: declare that stage's
        node dead now if its address refuses connections (the process is gone)."""
        reporter = self._node(str(req["node_id"]))
        with self.lock:
            suspect = self.nodes.get(self.pipelines[reporter.pipeline].slots.get(
                int(req["stage"]), ""))
        if suspect is None or not suspect.alive or not suspect.address:
            return {"dead": suspect is not None and not suspect.alive}
        if self.probe(suspect.address):
            return {"dead": False}  # alive: a dropped connection, repaired elsewhere
        with self.lock:
            if not suspect.alive:
                return {"dead": True}
            suspect.alive = False
            self._fail(suspect.pipeline, suspect.stage)
        log.warning("declared dead: %s (reported by %s, nothing listens at %s)",
                    suspect.node_id, reporter.node_id, suspect.address)
        return {"dead": True}

    def lost(self, req: dict) -> dict:
        """Node ``node_id``'s process is gone, as one that saw it end says: its supervisor
        (the parent that reaped it) or its own stub or service process. Dead now: nothing to
        probe, no heartbeat timeout to wait out. ``why``: for the log."""
        node_id = str(req["node_id"])
        with self.lock:
            node = self.nodes.get(node_id)
            if node is not None and node_id not in self.ended:
                self.ended.append(node_id)
            if node is None or not node.alive:
                return {"dead": node is not None}
            node.alive = False
            self._fail(node.pipeline, node.stage)
        log.warning("declared dead: %s (%s)", node_id, str(req.get("why", "its process ended")))
        return {"dead": True}

    def sweep(self) -> list[str]:
        """Declare silent nodes (and stages that never came back) dead; returns what died."""
        now, died = self.clock(), []
        with self.lock:
            for node in self.nodes.values():
                if node.alive and now - node.last_seen > self.timeout_s:
                    node.alive = False
                    died.append(node.node_id)
                    self._fail(node.pipeline, node.stage)
            for name, pipeline in self.pipelines.items():
                for stage in range(pipeline.depth):
                    # Only a pipeline that ran before this controller started can have lost
                    # a stage unseen; at a cluster's start a slow node is merely late.
                    missing = pipeline.rejoined and stage not in pipeline.slots
                    if missing and stage not in pipeline.failed and (
                        now - pipeline.first_seen > self.timeout_s
                    ):
                        died.append(f"{name}/stage{stage} (never registered)")
                        self._fail(name, stage)
        for what in died:
            log.warning("declared dead: %s", what)
        return died

    def _fail(self, name: str, stage: int) -> None:
        pipeline = self.pipelines[name]
        pipeline.failed.add(stage)
        pipeline.epoch += 1  # a plan in progress is void: the new one covers every lost stage
        pipeline.plan, pipeline.recovered = None, set()

    # -- recovery --------------------------------------------------------------

    def _maybe_plan(self, name: str, pipeline: Pipeline) -> None:
        if not pipeline.failed or pipeline.plan is not None:
            return
        if sum(self.nodes[n].alive for n in pipeline.slots.values()) < pipeline.depth:
            return  # wait for every lost stage to have a replacement
        pipeline.plan = make_plan(name, pipeline)
        # Every stage rolls back to the resume step and replicas are re-seeded from there.
        for j, t in pipeline.plan["resume"].items():
            for s in range(pipeline.depth):
                if t == 0:
                    pipeline.acks.pop((s, int(j)), None)
                else:
                    pipeline.acks[(s, int(j))] = t - 1
        if pipeline.plan["recompute"] and pipeline.depth > 1:
            log.warning("pipeline %s: replicas of stages %s lost too; recomputing from prompts",
                        name, sorted(pipeline.failed))
        log.info("pipeline %s: recovery plan epoch %d", name, pipeline.epoch)

    def plan(self, req: dict) -> dict:
        """The current plan of ``pipeline`` if its epoch is newer than ``after_epoch``."""
        with self.lock:
            pipeline = self.pipelines.get(str(req["pipeline"]))
            if pipeline is None:
                raise RequestError(f"unknown pipeline {req['pipeline']!r}",
                                   grpc.StatusCode.NOT_FOUND)
            fresh = pipeline.plan is not None and pipeline.epoch > int(req.get("after_epoch", -1))
            return {"epoch": pipeline.epoch, "state": pipeline.state,
                    "plan": pipeline.plan if fresh else None}

    def recovered(self, req: dict) -> dict:
        """A node finished the plan of ``epoch``; the last one resumes serving."""
        node = self._node(str(req["node_id"]))
        with self.lock:
            pipeline = self.pipelines[node.pipeline]
            if pipeline.plan is None or int(req["epoch"]) != pipeline.epoch:
                raise RequestError(f"no recovery of epoch {req['epoch']} in progress",
                                   grpc.StatusCode.FAILED_PRECONDITION)
            pipeline.recovered.add(node.node_id)
            if pipeline.recovered >= set(pipeline.slots.values()):
                log.info("pipeline %s recovered (epoch %d)", node.pipeline, pipeline.epoch)
                pipeline.failed, pipeline.plan, pipeline.recovered = set(), None, set()
            return {"epoch": pipeline.epoch, "state": pipeline.state}

    def status(self, req: dict) -> dict:
        now = self.clock()
        with self.lock:
            nodes = [
                {**asdict(n), "last_seen_s": round(now - n.last_seen, 3)}
                for n in self.nodes.values()
            ]
            pipelines = {
                name: {
                    "depth": p.depth, "state": p.state, "epoch": p.epoch,
                    "failed": sorted(p.failed),
                    "acks": [[s, j, t] for (s, j), t in sorted(p.acks.items())],
                }
                for name, p in self.pipelines.items()
            }
        return {"timeout_s": self.timeout_s, "nodes": nodes, "pipelines": pipelines}


def listening(address: str, timeout_s: float = 0.2) -> bool:
    """Something accepts TCP connections at ``host:port``. Refused means the process is
    gone; a timeout (an overloaded or partitioned host) counts as alive: the heartbeat
    timeout decides then."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


def make_plan(name: str, pipeline: Pipeline) -> dict:
    """Who restores whom, and the step of each microbatch to redo.

    Step 1: stage (x+1)%D holds x's replica and sends it to the new x.
    Step 2: stage (x-1)%D re-sends its own KV, the replica the old x held.
    Steps 3-4: microbatch j resumes at the first step a lost stage's replica
    lacks, ``min_x ack(x, j) + 1``, or earlier: the head goes back no further
    than its first unanswered step, which every surviving stage has computed
    (its own KV, cut back there). Redoing a step rewrites identical values. If
    a lost stage's holder is lost too (or D == 1), no replica survives:
    recompute (step 0).
    """
    depth, failed = pipeline.depth, pipeline.failed
    recompute = depth == 1 or any((x + 1) % depth in failed for x in failed)
    microbatches = sorted({j for (_, j) in pipeline.acks})
    resume = {}
    for j in microbatches:
        steps = [pipeline.acks.get((x, j)) for x in failed]
        resume[j] = 0 if recompute or None in steps else min(steps) + 1
    first = min(((t, j) for j, t in resume.items()), default=None)
    return {
        "epoch": pipeline.epoch,
        "pipeline": name,
        "depth": depth,
        "failed": sorted(failed),
        "restore": [] if recompute else [[(x + 1) % depth, x] for x in sorted(failed)],
        "rereplicate": [] if recompute else [[(x - 1) % depth, x] for x in sorted(failed)],
        "recompute": recompute,
        "resume": {str(j): t for j, t in resume.items()},
        "first": None if first is None else [first[1], first[0]],
    }


class ControllerServer:
    """The gRPC service plus the sweeper thread that detects silent nodes."""

    def __init__(self, state: ControllerState, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        """Answers calls signed with ``secret`` (the cluster's) only."""
        self.state = state
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)]
        )
        self._server.add_generic_rpc_handlers((service_handler({
            "Register": state.register,
            "Heartbeat": state.heartbeat,
            "Suspect": state.suspect,
            "Lost": state.lost,
            "Ack": state.ack,
            "Plan": state.plan,
            "Recovered": state.recovered,
            "Status": state.status,
        }, secret),))
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the controller to {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="controller-sweep", daemon=True)

    def start(self) -> ControllerServer:
        self._server.start()
        self._sweeper.start()
        return self

    def _sweep(self) -> None:
        period = min(0.1, self.state.timeout_s / 4)
        while not self._stop.wait(period):
            self.state.sweep()

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self._server.stop(grace_s).wait(grace_s + 1)
        self._sweeper.join(timeout=grace_s + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.fault.controller", description="the DejaVu controller"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--timeout-s", type=float, default=DEAD_AFTER_S,
                        help="a node silent this long is declared dead")
    parser.add_argument("--secret-file", help=f"the cluster secret's file (else ${ENV})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        server = ControllerServer(ControllerState(args.timeout_s), load_secret(args.secret_file),
                                  args.host, args.port).start()
    except (OSError, RuntimeError, ValueError) as e:
        print(f"controller: {e}", file=sys.stderr)
        return 2
    print(f"controller listening on {server.address}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
