"""Fault tolerance on the real token pipeline: KV replicas, a controller, four-step recovery.

:class:`ReplicatedPipeline` wraps a :class:`~orchestrator.pipeline.pipeline.TokenPipeline`
(its stages are threads in this process) and gives every stage what a stage
node has: its own transport endpoint (a :class:`~orchestrator.kv.transport.local.LocalFabric`
stands in for the network), a controller client heartbeating to the controller
*process*, a :class:`~orchestrator.fault.replication.Replicator` streaming each
step's KV delta to stage (x+1)%D, and a :class:`~orchestrator.fault.replication.ReplicaStore`
holding stage (x-1)%D's replicas. It plugs in through the stage hooks only
(``on_step``: replicate, then take in landed deltas; ``on_release``: free the replica).

A *kill* (:class:`Kill`, a drill) does to a stage what a crash does: its
heartbeats stop, its endpoint leaves the fabric, its KV is wiped and its
thread ends mid-step. Nothing here tells anyone: the controller notices the
missing heartbeats; a supervisor thread watching the controller starts a hot
spare for the lost stage (same weights), waits for the controller's plan, and
carries it out (:mod:`orchestrator.fault.recovery`): pause the head, see the
steps in flight out, (1) the holder sends the lost stage's replica to the
spare, (4) every stage rolls back to the step the controller picked per
microbatch, (2) replicas are seeded again, and the head resumes there. If a
replica holder died too, or replication is off (the restart-from-scratch
baseline), every running request starts over from its prompt.

A request whose prompt KV was lost (it joined at or after the step to redo)
starts over: colocated, its prompt runs again in the pipeline; disaggregated,
the pipeline's own P-worker prefills it again (a head fed by P-nodes elsewhere
ends it with an error saying so).

Limits: redone steps are exact for greedy sampling (a seeded sampler's state is
not rolled back); tokens cut by a rollback reach ``on_token`` again when redone
(the same tokens; only after an unsettled failure); the stages are threads of
this process. Across processes (Triton T-nodes) the same steps run as control
requests: :mod:`orchestrator.fault.stage_recovery`.
"""

from __future__ import annotations

import base64
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from orchestrator.engine.sampling import Sampler
from orchestrator.fault.client import ControllerClient, NodeSpec, query_status
from orchestrator.fault.recovery import restore_stage
from orchestrator.fault.replication import ReplicaStore, Replicator
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.layout import KVCache
from orchestrator.pipeline.link import KVProbe, StepMessage
from orchestrator.pipeline.pipeline import TokenPipeline
from orchestrator.pipeline.stage import StageLost

log = logging.getLogger("dejavu.fault.replicated")

SECRET = b"dejavu-replicas-in-one-process"  # KV and controller calls


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
    repair_s: float  # plan -> head resumed (drain, restore, rollback, re-seed)
    resume: dict[int, int]  # microbatch -> step the controller picked
    recompute: bool
    lost_steps: int  # microbatch steps in flight that died with the stage
    restarted: int  # requests that started over from their prompt


class FaultNode:
    """One stage's fault-tolerance side: endpoint, controller client, replicas."""

    def __init__(self, owner: ReplicatedPipeline, stage: int) -> None:
        self.stage, self.alive = stage, True
        pipeline, depth = owner.pipeline, owner.pipeline.depth
        self.layout = pipeline.engines[stage].kv_layout
        self.transport = LocalTransport(owner.fabric, f"stage{stage}-{uuid.uuid4().hex[:6]}")
        spec = NodeSpec(owner.name, stage, depth,
                        transport=base64.b64encode(self.transport.metadata()).decode())
        self.client = ControllerClient(owner.controller, spec, SECRET, owner.heartbeat_s).start()
        slots, timeout_s = owner.replica_slots, owner.kv_timeout_s
        # Where this stage's own KV lands when a holder restores it (recovery step 1).
        self.landing = ReplicaStore(self.transport, self.layout, slots, SECRET,
                                    timeout_s=timeout_s)
        self.store: ReplicaStore | None = None  # replicas of stage (x-1)%D
        if owner.replicate:
            source = pipeline.engines[(stage - 1) % depth].kv_layout
            self.store = ReplicaStore(self.transport, source, slots, SECRET, self.client.ack,
                                      timeout_s)
        self.replicator: Replicator | None = None

    def replicate_to(self, holder: FaultNode, max_batch: int, timeout_s: float) -> None:
        if self.replicator is not None:
            self.replicator.close()
        assert holder.store is not None
        self.transport.add_peer(holder.transport.name, holder.transport.metadata())
        self.replicator = Replicator(self.stage, self.transport, self.layout, SECRET,
                                     holder.store, max_batch, timeout_s)

    def kill(self) -> None:
        """What a crash does to the others: no beats, no endpoint, no memory."""
        self.alive = False
        self.client.stop()
        if self.replicator is not None:
            self.replicator.close()
        self.transport.close()
        self.store = None

    def close(self) -> None:
        if self.alive:
            self.kill()


class ReplicatedPipeline:
    def __init__(
        self,
        pipeline: TokenPipeline,
        controller: str,
        name: str | None = None,
        *,
        replicate: bool = True,
        kills: list[Kill] | tuple[Kill, ...] = (),
        heartbeat_s: float = 0.05,
        plan_timeout_s: float = 30.0,
        kv_timeout_s: float = 10.0,
    ) -> None:
        """Wraps a not yet started ``pipeline``; ``replicate=False`` is the restart baseline."""
        if pipeline.stages[0].thread.is_alive():
            raise RuntimeError("wrap the TokenPipeline before starting it")
        if replicate and pipeline.depth < 2:
            raise ValueError("replication needs depth >= 2 (the replica lives on the next stage)")
        for kill in kills:
            if not 0 <= kill.stage < pipeline.depth:
                raise ValueError(f"{kill}: no stage {kill.stage} in a depth-{pipeline.depth} "
                                 "pipeline")
        self.pipeline, self.controller = pipeline, controller
        self.name = name or f"pipeline-{uuid.uuid4().hex[:8]}"
        self.replicate, self.kills = replicate, list(kills)
        self.heartbeat_s, self.plan_timeout_s = heartbeat_s, plan_timeout_s
        self.kv_timeout_s = kv_timeout_s
        self.replica_slots = max(16, 2 * pipeline.batch_size * pipeline.num_microbatches)
        self.fabric = LocalFabric()
        self.nodes = [FaultNode(self, s) for s in range(pipeline.depth)]
        self._connect()
        for i, stage in enumerate(pipeline.stages):
            stage.on_step = functools.partial(self._on_step, i)
            stage.on_release = functools.partial(self._on_release, i)
        self.epoch = 0
        self.recoveries: list[Recovery] = []
        self.steps_done: list[tuple[int, int, float]] = []  # (microbatch, step, s since start)
        self.errors: list[str] = []
        self._killed_at: float | None = None
        self._controller_timeout_s = 1.0  # as of the last status
        self._spares: set[int] = set()  # stages replaced by the recovery in progress
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="fault-supervisor",
                                            daemon=True)
        self.started_at = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> ReplicatedPipeline:
        deadline = time.monotonic() + timeout_s
        while not all(n.client.connected for n in self.nodes):
            if time.monotonic() > deadline:
                for node in self.nodes:
                    node.close()
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
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ReplicatedPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests and benchmarks read -----------------------------------------------

    def inject(self, kill: Kill) -> None:
        """Arm one more kill (from any thread)."""
        with self._lock:
            self.kills.append(kill)

    def replicas_held(self, timeout_s: float = 10.0) -> int:
        """Replicas still held once every stage freed its ended requests' KV."""
        deadline = time.monotonic() + timeout_s
        while self.pipeline.kv_held() and time.monotonic() < deadline:
            time.sleep(0.01)  # the last releases ride on a final step
        self.flush()
        return sum(len(n.store.held) for n in self.nodes if n.store is not None)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Every replica so far landed and its ack reached the controller."""
        for node in self.nodes:
            if node.alive and node.replicator is not None and node.replicator.error is None:
                node.replicator.flush()
        deadline = time.monotonic() + timeout_s
        while any(n.client.unsent_acks for n in self.nodes if n.alive):
            if time.monotonic() > deadline:
                raise TimeoutError("acks did not reach the controller")
            time.sleep(0.005)

    # -- the stage hooks (on each stage's thread) ----------------------------------------

    def _on_step(self, stage: int, microbatch: int, step: int, seq_ids: list[int],
                 caches: list[KVCache]) -> None:
        node = self.nodes[stage]
        if not node.alive:  # killed by another stage's drill while computing
            raise StageLost(stage)
        self._maybe_kill(stage, microbatch, step)
        if stage == self.pipeline.depth - 1:  # the step's tokens are out
            self.steps_done.append((microbatch, step, time.monotonic() - self.started_at))
        if node.replicator is not None:
            node.replicator.step(microbatch, step, [str(s) for s in seq_ids], caches)
        if node.store is not None:
            node.store.progress()

    def _on_release(self, stage: int, seq_id: int) -> None:
        replicator = self.nodes[stage].replicator
        if replicator is not None:
            replicator.remove(str(seq_id))

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
            self.nodes[other].kill()
            self.pipeline.stages[other].retire()
            self._wipe(other)
        self.nodes[stage].kill()
        self.pipeline.stages[stage].retire()
        self._wipe(stage)
        raise StageLost(stage)

    def _wipe(self, stage: int) -> None:
        kv = self.pipeline.kv[stage]
        for seq_id in kv.held():  # its memory is gone with it
            kv.drop(seq_id)

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
                self.pipeline.report_failure(self.errors[-1])
                return

    def _declared_failed(self) -> set[int]:
        status = query_status(self.controller, SECRET)
        self._controller_timeout_s = float(status["timeout_s"])
        return set(status["pipelines"].get(self.name, {}).get("failed", []))

    def _plan(self, failed: set[int]) -> dict:
        """Hot spares for the lost stages register in their slots; the controller's plan
        once it covers them all."""
        for x in sorted(failed):
            if self.nodes[x].alive:
                if self.nodes[x].client.connected and x not in self._spares:
                    raise RuntimeError(f"stage {x} was declared dead while serving (too slow "
                                       "for the heartbeat timeout); fencing is not done")
                continue  # its spare is registered already
            self.nodes[x] = FaultNode(self, x)
            self._spares.add(x)
        plan = {"epoch": self.epoch, "failed": []}
        while not failed <= set(plan["failed"]):  # a plan made before a death was seen
            plan = self.nodes[min(failed)].client.wait_for_recovery_plan(plan["epoch"],
                                                                         self.plan_timeout_s)
        return plan

    def _recover(self, failed: set[int]) -> None:
        pipeline = head = self.pipeline  # the head is the in-process pipeline
        self._spares = set()
        head.pause()
        while True:
            plan = self._plan(failed)
            planned = time.monotonic()
            for x in plan["failed"]:
                pipeline.stages[x].retire()  # its thread is over: nobody takes its messages
            try:
                # Past the controller's timeout every stage lost with these was declared.
                lost = self._drain(plan["failed"], 2 * self._controller_timeout_s)
                break
            except TimeoutError:
                more = self._declared_failed() - set(plan["failed"])
                if not more:
                    raise
                failed = set(plan["failed"]) | more  # declared late: a new plan covers it
        failed = plan["failed"]
        recompute = plan["recompute"] or not self.replicate
        resume = ({j: 0 for j in range(pipeline.num_microbatches)} if recompute
                  else {int(j): int(t) for j, t in plan["resume"].items()})

        running = {s.seq_id: s for s in head.running()}
        lengths = head.rewind(resume)  # step 3: the head goes back to (j, t)
        restarted = len(running) - len(lengths)
        spares = {x: pipeline.replace_stage(x) for x in failed}
        for holder, x in [] if recompute else plan["restore"]:  # step 1
            self._restore(holder, x, lengths)
        for i, kv in enumerate(pipeline.kv):  # step 4: survivors forget the steps to redo
            if i not in failed:
                kv.rollback(lengths)
        if pipeline.depth - 1 in failed:  # the last stage samples: its samplers come back too
            spares[pipeline.depth - 1].samplers = {
                s: Sampler(running[s].sampling) for s in lengths}
        if self.replicate:
            # Step 2, and more: a replica cannot be cut back like a cache, so every stage
            # seeds its replicas again from its rolled-back KV.
            for node in self.nodes:
                for rid in node.store.held:
                    node.store.free(rid)
            self._connect()
            for node, kv in zip(self.nodes, pipeline.kv, strict=True):
                held = kv.held()
                node.replicator.seed([str(s) for s in held], list(held.values()))
        for spare in spares.values():
            spare.start()
        for node in self.nodes:
            node.client.recovered(plan["epoch"])
        self.epoch = plan["epoch"]
        head.resume()
        killed_at = self._killed_at or planned
        self._killed_at = None
        self.recoveries.append(Recovery(
            failed, killed_at - self.started_at, planned - killed_at,
            time.monotonic() - planned, resume, recompute, lost, restarted))
        how = "restarted from prompts" if recompute else f"resumed at {resume}"
        log.warning("stages %s recovered: %s", failed, how)

    def _drain(self, failed: list[int], timeout_s: float) -> int:
        """See every step in flight out: those past the lost stages reach the head, those
        waiting at a lost stage are dropped (returns how many)."""
        links, depth, lost = self.pipeline.links, self.pipeline.depth, 0
        for start in [0, *(x + 1 for x in failed)]:
            end = min((x for x in failed if x >= start), default=depth)
            if end == depth:
                self.pipeline.drain(links[start], timeout_s)
                continue
            marker = f"fault-drain-{uuid.uuid4().hex}"
            links[start].send(KVProbe({}, release={-1: marker}), timeout_s)
            deadline = time.monotonic() + timeout_s
            while True:
                message = links[end].recv(max(0.0, deadline - time.monotonic()))
                if message is None:
                    raise TimeoutError(f"stages {start}..{end - 1} did not drain")
                if isinstance(message, KVProbe) and message.release.get(-1) == marker:
                    break
                lost += isinstance(message, StepMessage)
        return lost

    def _restore(self, holder_stage: int, x: int, lengths: dict[int, int]) -> None:
        """Step 1: the holder sends x's replica, cut to the resume point, to the spare."""
        holder, spare = self.nodes[holder_stage], self.nodes[x]
        assert holder.store is not None
        holder.store.progress()  # take in the deltas that landed since its last step
        sender = KVSender(holder.transport, holder.store.layout, SECRET)
        holder.transport.add_peer(spare.transport.name, spare.transport.metadata())
        caches = restore_stage(holder.store, sender, spare.landing,
                               self.pipeline.engines[x],
                               {str(s): n for s, n in lengths.items()}, self.kv_timeout_s)
        for rid, cache in caches.items():
            self.pipeline.kv[x].add(int(rid), cache)

    def _connect(self) -> None:
        if not self.replicate:
            return
        depth = self.pipeline.depth
        for s, node in enumerate(self.nodes):
            node.replicate_to(self.nodes[(s + 1) % depth], self.pipeline.batch_size,
                              self.kv_timeout_s)
