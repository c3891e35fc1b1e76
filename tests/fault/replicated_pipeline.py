"""Test helper: KV replicas and stage recovery on an in-process pipeline, by the T-nodes'
own code (the served path is the supervisor driving ``recover_stage`` across T-nodes).

:class:`ReplicatedPipeline` gives every stage node of a
:class:`~orchestrator.pipeline.local.LocalPipeline` what a T-node with
``replicate=on`` has: a controller client heartbeating to the controller
*process* (and acking replicated steps), its replicas
(:class:`~orchestrator.fault.node_replication.NodeReplication`) and its
recovery operations (:class:`~orchestrator.fault.stage_recovery.RecoveryOps`).
A supervisor thread does what the cluster's supervisor does: it asks the
controller which stages it declared dead, puts a hot spare in each lost slot
(a new stage node on the same, already loaded engine: no process start, no
model load), waits for the controller's plan and carries it out with
:func:`~orchestrator.fault.stage_recovery.recover_stage`, the same four steps
as across tritonservers, only called directly instead of as control requests.

A :class:`Kill` (a drill) does to a stage what a crash does: its heartbeats
stop, its endpoints leave the fabric, its KV is wiped, its thread ends
mid-step. Nothing tells anyone: the controller notices the missing heartbeats.
With ``replicate=False`` (the restart-from-scratch baseline) there are no
replicas: every running request starts over from its prompt, which is also
what a recovery falls back to when a lost stage's replica holder died too.

Limits, as on the served path: stage 0 holds the head, and its loss is not
recovered here (the frontend runs its requests again elsewhere); redone steps
are exact for greedy sampling.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from controller_helpers import unsent_acks, wait_for_plan

from orchestrator.fault.client import ControllerClient, NodeSpec, query_status
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.fault.stage_recovery import RecoveryOps, recover_stage
from orchestrator.layout import KVCache
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import StageNode
from orchestrator.pipeline.stage import StageLost

log = logging.getLogger("dejavu.tests.replicated")

SECRET = b"dejavu-replicas-in-one-process"  # KV, replica and controller calls


@dataclass(frozen=True)
class Kill:
    """Kill ``stage`` right after it computed ``step`` of ``microbatch`` (None: any), before
    that step is replicated or sent on. ``settled``: first let every replica and ack so far
    land, so the step to redo is exactly ``step``; unsettled, acks in flight die with the
    stage and recovery may redo a few more steps."""

    stage: int
    microbatch: int | None = None
    step: int | None = None
    settled: bool = True
    also: tuple[int, ...] = ()  # stages lost at the same moment (a rack losing power)


@dataclass
class Recovery:
    stages: list[int]
    at_s: float  # when the (first) stage was killed, seconds since start()
    detect_s: float  # kill -> the controller's plan (heartbeat timeout, spare registration)
    repair_s: float  # plan -> head resumed (the four steps)
    resume: dict[int, int]  # microbatch -> step redone from (recompute: 0)
    recompute: bool
    restarted: int  # running requests that started over from their prompt


class NoReplicas:
    """A stage without replicas (the restart baseline): recovery can only recompute."""

    def __init__(self, node: StageNode) -> None:
        self.node = node

    def endpoints(self) -> bytes:
        return json.dumps({"stage": self.node.index}).encode()

    def connect(self, next: bytes, previous: bytes) -> None:  # noqa: A002  (the ops' word)
        """Nothing to hold or stream."""

    def reconnect(self, next: bytes) -> None:  # noqa: A002
        """Nothing streams to the successor."""

    def rollback(self, lengths: dict[int, int]) -> None:
        self.node.kv.rollback(lengths)

    def reseed(self) -> None:
        """No replica to seed."""

    def held_counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Nothing to free."""


class _Member:
    """One stage node and its fault-tolerance side, addressed as ``url`` by the steps."""

    def __init__(self, owner: ReplicatedPipeline, node: StageNode) -> None:
        self.owner, self.node, self.alive = owner, node, True
        depth = owner.pipeline.config.depth
        self.url = f"local://{owner.name}/{node.name}"
        self.client = ControllerClient(owner.controller,
                                       NodeSpec(owner.name, node.index, depth, address=self.url),
                                       SECRET, owner.heartbeat_s).start()
        self.replication: NodeReplication | NoReplicas = (
            NodeReplication(node, SECRET, make_transport=owner.pipeline.transport,
                            ack=self.client.ack, timeout_s=owner.kv_timeout_s)
            if owner.replicate else NoReplicas(node))
        self.ops = RecoveryOps(node, self.replication, self.client).ops()

    def call(self, op: str, args: list[bytes]) -> bytes:
        """A T-node's control op (what its service answers over gRPC)."""
        if op == "endpoints":
            return self.node.endpoints()
        answer = b""
        if op == "connect":
            self.node.connect(*args)
        elif op == "start":
            self.node.start()
        else:
            answer = self.ops[op](*args)
        if op == "replicate":  # a spare's hooks are in place: drills and timing go on
            self.owner.instrument(self)
        return answer

    def crash(self) -> None:
        """What a crash does to the others: no beats, no endpoints, no memory."""
        self.alive = False
        self.client.stop()
        self.node.worker.retire()  # its thread ends (at once when called on it)
        self.replication.close()
        for transport in (self.node.kv_transport, self.node.link_transport):
            if transport is not None:
                transport.close()
        for seq_id in self.node.kv.held():
            self.node.kv.drop(seq_id)

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.client.stop()
            self.replication.close()


class ReplicatedPipeline:
    def __init__(
        self,
        pipeline: LocalPipeline,
        controller: str,
        name: str,
        *,
        replicate: bool = True,
        kills: list[Kill] | tuple[Kill, ...] = (),
        heartbeat_s: float = 0.05,
        plan_timeout_s: float = 30.0,
        kv_timeout_s: float = 10.0,
    ) -> None:
        """Wraps a not yet started ``pipeline`` (its config needs ``recover_timeout_s``);
        ``replicate=False`` is the restart baseline. ``name``: unique at the controller."""
        depth = pipeline.config.depth
        if depth < 2:
            raise ValueError("replication needs depth >= 2 (the replica lives on the next stage)")
        if pipeline.config.recover_timeout_s is None:
            raise ValueError("the pipeline must wait for a repair: set recover_timeout_s")
        for kill in kills:
            if not 0 < kill.stage < depth or not all(0 < x < depth for x in kill.also):
                raise ValueError(f"{kill}: stages 1..{depth - 1} of a depth-{depth} pipeline "
                                 "can be lost (stage 0 holds the head)")
        self.pipeline, self.controller, self.name = pipeline, controller, name
        self.replicate, self.kills = replicate, list(kills)
        self.heartbeat_s, self.plan_timeout_s = heartbeat_s, plan_timeout_s
        self.kv_timeout_s = kv_timeout_s
        self.members = [_Member(self, node) for node in pipeline.nodes]
        endpoints = [m.replication.endpoints() for m in self.members]
        for i, member in enumerate(self.members):
            member.replication.connect(endpoints[(i + 1) % depth], endpoints[i - 1])
            self.instrument(member)
        self.epoch, self.spares = 0, 0
        self.recoveries: list[Recovery] = []
        self.steps_done: list[tuple[int, int, float]] = []  # (microbatch, step, s since start)
        self.errors: list[str] = []
        self._killed_at: float | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="local-supervisor",
                                            daemon=True)
        self.started_at = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> ReplicatedPipeline:
        deadline = time.monotonic() + timeout_s
        while not all(m.client.connected for m in self.members):
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"stages did not register with the controller "
                                   f"{self.controller} in {timeout_s} s")
            time.sleep(0.01)
        self.started_at = time.monotonic()
        self.pipeline.start()
        self._supervisor.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join(self.plan_timeout_s)
        self.pipeline.stop()
        for member in self.members:
            member.close()

    def __enter__(self) -> ReplicatedPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests and benchmarks read -----------------------------------------------

    def inject(self, kill: Kill) -> None:
        """Arm one more kill (from any thread)."""
        with self._lock:
            self.kills.append(kill)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Every replica so far landed and its ack reached the controller."""
        for member in self.members:
            if member.alive and isinstance(member.replication, NodeReplication):
                replicator = member.replication.replicator
                if replicator is not None and replicator.error is None:
                    replicator.flush()
        deadline = time.monotonic() + timeout_s
        while any(unsent_acks(m.client) for m in self.members if m.alive):
            if time.monotonic() > deadline:
                raise TimeoutError("acks did not reach the controller")
            time.sleep(0.005)

    def replicas_held(self, timeout_s: float = 10.0) -> int:
        """Replicas still held once every stage freed its ended requests' KV."""
        deadline = time.monotonic() + timeout_s
        while self.pipeline.kv_held() and time.monotonic() < deadline:
            time.sleep(0.01)  # the last releases ride on a final step
        self.flush()
        return sum(m.replication.held_counts().get("replicas", 0) for m in self.members)

    # -- drills (on the stage's thread) ---------------------------------------------------

    def instrument(self, member: _Member) -> None:
        """Kills fire, and the last stage's steps are timed, before a step is replicated."""
        worker = member.node.worker
        replicate = worker.on_step
        last = member.node.index == self.pipeline.config.depth - 1

        def on_step(microbatch: int, step: int, seq_ids: list[int],
                    caches: list[KVCache]) -> None:
            if not member.alive:  # killed by another stage's drill while computing
                raise StageLost(member.node.index)
            self._maybe_kill(member.node.index, microbatch, step)
            if last:
                self.steps_done.append((microbatch, step, time.monotonic() - self.started_at))
            if replicate is not None:
                replicate(microbatch, step, seq_ids, caches)

        worker.on_step = on_step

    def _maybe_kill(self, stage: int, microbatch: int, step: int) -> None:
        with self._lock:
            kill = next((k for k in self.kills if k.stage == stage
                         and k.microbatch in (None, microbatch) and k.step in (None, step)),
                        None)
            if kill is None:
                return
            self.kills.remove(kill)
        if kill.settled:
            self.flush()
        log.warning("killing stage %s at microbatch %d step %d", [stage, *kill.also],
                    microbatch, step)
        self._killed_at = self._killed_at or time.monotonic()
        for other in kill.also:
            self.members[other].crash()
        self.members[stage].crash()
        raise StageLost(stage)

    # -- detection and recovery (the supervisor's thread) ----------------------------------

    def _supervise(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            try:
                failed = self._declared_failed()
            except Exception as exc:  # the controller is away: serving goes on
                log.debug("controller status: %s", exc)
                continue
            if not failed:
                continue
            try:
                self._recover(failed)
            except Exception as exc:
                log.exception("recovery failed")
                self.errors.append(f"recovery of stages {sorted(failed)} failed: {exc}")
                self.pipeline.head.report_failure(self.errors[-1])
                return

    def _declared_failed(self) -> set[int]:
        status = query_status(self.controller, SECRET)
        return set(status["pipelines"].get(self.name, {}).get("failed", []))

    def _replace(self, x: int) -> None:
        """A hot spare in slot x: a new stage node on the same engine, registered."""
        old = self.members[x]
        if old.alive:
            raise RuntimeError(f"stage {x} was declared dead while serving (too slow for "
                               "the heartbeat timeout); fencing is not done")
        old.close()
        self.spares += 1
        spare = StageNode(None, x, self.pipeline.config, secret=self.pipeline.secret,
                          engine=old.node.engine, make_transport=self.pipeline.transport,
                          name=f"{self.name}-{x}-spare{self.spares}")
        if old.node.blocks is not None:  # a prefix cache: the spare keeps an (empty) pool
            spare.reuse_prefixes(old.node.blocks.block_tokens, old.node.blocks.capacity_blocks)
        self.pipeline.nodes[x] = spare
        self.members[x] = _Member(self, spare)

    def _plan(self, failed: set[int]) -> dict:
        """Spares in every lost slot, also those declared meanwhile; the controller's plan
        once it covers them all (a plan made before a death was seen does not)."""
        replaced: set[int] = set()
        plan = {"epoch": self.epoch, "failed": []}
        deadline = time.monotonic() + self.plan_timeout_s
        while True:
            for x in sorted(failed - replaced):
                self._replace(x)
                replaced.add(x)
            undeclared = any(not m.alive for m in self.members)  # the controller sees it soon
            if not undeclared and failed <= set(plan["failed"]):
                return plan
            if time.monotonic() > deadline:
                raise TimeoutError(f"no recovery plan for stages {sorted(failed)} in "
                                   f"{self.plan_timeout_s} s")
            if undeclared:
                time.sleep(self.heartbeat_s)
            else:
                plan = wait_for_plan(self.controller, SECRET, self.name, plan["epoch"],
                                     max(0.0, deadline - time.monotonic()))
            failed |= self._declared_failed()

    def _recover(self, failed: set[int]) -> None:
        plan = self._plan(failed)
        planned = time.monotonic()
        if not self.replicate:  # nothing to restore from: every request starts over
            plan = {**plan, "recompute": True}
        running = len(self.pipeline.head.running())
        urls = {m.url: m for m in self.members}
        kept = recover_stage(lambda url, op, args: urls[url].call(op, args),
                             [m.url for m in self.members], plan)
        self.epoch = plan["epoch"]
        killed_at = self._killed_at or planned
        self._killed_at = None
        resume = (dict.fromkeys(range(self.pipeline.config.microbatches), 0)
                  if plan["recompute"] else {int(j): int(t) for j, t in plan["resume"].items()})
        self.recoveries.append(Recovery(
            sorted(int(x) for x in plan["failed"]), killed_at - self.started_at,
            planned - killed_at, time.monotonic() - planned, resume, bool(plan["recompute"]),
            running - len(kept)))
        log.warning("%s: stages %s recovered", self.name, plan["failed"])
