"""A failure drill: D engine stages in one process, a real controller, a stage killed mid-run.

Each stage is a node with its own transport endpoint (on a
:class:`~orchestrator.kv.transport.local.LocalFabric`), its own controller
client (heartbeats over gRPC to the controller process), its KV caches, the
replica store of the stage before it and a replicator to the stage after.
Microbatches take turns, one step at a time through every stage (no overlap
between stages: this measures recovery, not pipelining).

A *kill* does what a dead process does to the others: heartbeats stop, the
endpoint leaves the fabric (writes to it fail), its memory is gone. The drill
then waits for the controller's plan, like every node would, carries it out
and resumes. With ``replicate=False`` it is the restart-from-scratch baseline.
The hot spare that replaces a stage reuses the loaded weights of that stage.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from orchestrator.engine.torch_engine import TorchEngine
from orchestrator.fault.client import ControllerClient, NodeSpec
from orchestrator.fault.recovery import length_before, restore_stage, resume_steps, rollback
from orchestrator.fault.replication import ReplicaStore, Replicator
from orchestrator.kv.connector import KVSender
from orchestrator.kv.layout import KVCache
from orchestrator.kv.transport.local import LocalFabric, LocalTransport

log = logging.getLogger("dejavu.fault.drill")

SECRET = b"dejavu-drill"


class StageDown(RuntimeError):
    def __init__(self, stage: int) -> None:
        super().__init__(f"stage {stage} is down")
        self.stage = stage


@dataclass(frozen=True)
class Kill:
    """Kill ``stage`` just before ``microbatch`` runs ``step`` on it (once).

    ``settled``: first let every replica and ack of the steps so far reach the
    controller, so the step to redo is known exactly (tests). Unsettled, the
    acks still in flight die with the node and recovery redoes a few more steps.
    """

    step: int
    stage: int
    microbatch: int = 0
    settled: bool = True


@dataclass
class DrillConfig:
    controller: str
    depth: int
    microbatch_size: int
    num_microbatches: int
    max_tokens: int
    replicate: bool = True
    pipeline: str = "drill"
    heartbeat_s: float = 0.05
    plan_timeout_s: float = 30.0
    kv_timeout_s: float = 10.0
    num_slots: int = 64

    def __post_init__(self) -> None:
        for name in ("depth", "microbatch_size", "num_microbatches", "max_tokens", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replicate and self.depth < 2:
            raise ValueError("replication needs depth >= 2 (the replica lives on the next stage)")


@dataclass
class Recovery:
    stages: list[int]
    at_s: float  # when the stage was killed, from the run's start
    wait_s: float  # kill -> plan (detection, replacement registration)
    repair_s: float  # plan -> resumed (steps 1, 2 and rollback)
    resume: dict[int, int]
    recompute: bool


@dataclass
class DrillResult:
    outputs: dict[str, list[int]]
    step_done: dict[int, list[tuple[int, float]]]  # microbatch -> (step, seconds since start)
    finished: list[tuple[float, str]]  # (seconds since start, request id)
    recoveries: list[Recovery] = field(default_factory=list)
    replicas_held_after: int = 0  # replica slots still held when every request ended


class StageNode:
    def __init__(self, drill: Drill, stage: int) -> None:
        cfg = drill.config
        self.stage, self.engine = stage, drill.engines[stage]
        self.transport = LocalTransport(drill.fabric, f"stage{stage}-{uuid.uuid4().hex[:6]}")
        self.caches: dict[str, KVCache] = {}
        self.alive = True
        spec = NodeSpec(cfg.pipeline, stage, cfg.depth,
                        transport=base64.b64encode(self.transport.metadata()).decode())
        self.client = ControllerClient(cfg.controller, spec, cfg.heartbeat_s).start()
        self.inbox = ReplicaStore(self.transport, self.engine.kv_layout, cfg.num_slots, SECRET,
                                  timeout_s=cfg.kv_timeout_s)
        self.store = None
        if cfg.replicate:
            source = drill.engines[(stage - 1) % cfg.depth].kv_layout
            self.store = ReplicaStore(self.transport, source, cfg.num_slots, SECRET,
                                      self.client.ack, cfg.kv_timeout_s)
        self.replicator: Replicator | None = None

    def replicate_to(self, holder: StageNode, max_batch: int, timeout_s: float) -> None:
        if self.replicator is not None:
            self.replicator.close()
        assert holder.store is not None
        self.transport.add_peer(holder.transport.name, holder.transport.metadata())
        self.replicator = Replicator(self.stage, self.transport, self.engine.kv_layout, SECRET,
                                     holder.store, max_batch, timeout_s)

    def kill(self) -> None:
        self.alive = False
        self.client.stop()
        if self.replicator is not None:
            self.replicator.close()
        self.transport.close()
        self.caches.clear()
        self.store = None  # the process's memory is gone with it

    def close(self) -> None:
        if self.alive:
            self.kill()


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class Drill:
    def __init__(self, config: DrillConfig, engines: list[TorchEngine]) -> None:
        if len(engines) != config.depth:
            raise ValueError(f"{len(engines)} engines for a depth-{config.depth} pipeline")
        self.config, self.engines = config, engines
        self.fabric = LocalFabric()
        self.nodes = [StageNode(self, s) for s in range(config.depth)]
        self.epoch = 0
        self._connect(range(config.depth))

    def _connect(self, stages) -> None:
        if not self.config.replicate:
            return
        for s in stages:
            holder = self.nodes[(s + 1) % self.config.depth]
            self.nodes[s].replicate_to(holder, self.config.microbatch_size,
                                       self.config.kv_timeout_s)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def wait_registered(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n.client.connected for n in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("stages did not register with the controller")
            time.sleep(0.01)

    # -- the run ---------------------------------------------------------------

    def run(self, prompts: list[list[int]], kills: list[Kill] = ()) -> DrillResult:
        """Generate ``max_tokens`` greedy tokens per prompt, refilling microbatches as they end."""
        self.wait_registered()
        self.requests = {f"r{i}": _Request(f"r{i}", list(p)) for i, p in enumerate(prompts)}
        waiting = deque(self.requests)
        self.batches: dict[int, list[str]] = {}
        self.steps: dict[int, int] = {}
        self.start = time.perf_counter()
        self.result = DrillResult({}, {}, [])
        pending, next_id = list(kills), 0
        while waiting or self.batches:
            while waiting and len(self.batches) < self.config.num_microbatches:
                take = min(self.config.microbatch_size, len(waiting))
                self.batches[next_id] = [waiting.popleft() for _ in range(take)]
                self.steps[next_id], next_id = 0, next_id + 1
            for j in sorted(self.batches):
                for kill in [k for k in pending if (k.microbatch, k.step) == (j, self.steps[j])]:
                    pending.remove(kill)
                    if kill.settled:
                        self._settle()
                    self._kill(kill.stage)
                try:
                    self._step(j)
                except StageDown:
                    self._recover()
                    break
        self._drain_replication()
        self.result.outputs = {rid: r.tokens for rid, r in self.requests.items()}
        self.result.replicas_held_after = sum(
            len(n.store.held) for n in self.nodes if n.store is not None
        )
        return self.result

    def _step(self, j: int) -> None:
        rids, step = self.batches[j], self.steps[j]
        reqs = [self.requests[r] for r in rids]
        if step == 0:
            x: list[torch.Tensor] | torch.Tensor = [torch.tensor(r.prompt) for r in reqs]
        else:
            x = torch.tensor([r.tokens[-1] for r in reqs])
        for node in self.nodes:
            if node.alive and node.client.fenced.is_set():
                self._kill(node.stage)  # declared dead (it was too slow): it must stop serving
            if not node.alive:
                raise StageDown(node.stage)
            if step == 0:
                caches = [node.caches.setdefault(r, node.engine.new_cache()) for r in rids]
                x = node.engine.prefill(x, caches)
            else:
                caches = [node.caches[r] for r in rids]
                x = node.engine.decode(x, caches)
            if node.replicator is not None:
                node.replicator.step(j, step, rids, caches)
            if node.store is not None:
                node.store.progress()
        logits = torch.stack(x) if step == 0 else x
        now = time.perf_counter() - self.start
        for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            req.tokens.append(token)
            if len(req.tokens) >= self.config.max_tokens:
                req.done = True
                self.result.finished.append((now, req.rid))
                for node in self.nodes:
                    node.caches.pop(req.rid, None)
                    if node.replicator is not None:
                        node.replicator.remove(req.rid)
        self.result.step_done.setdefault(j, []).append((step, now))
        self.batches[j] = [r for r in rids if not self.requests[r].done]
        self.steps[j] = step + 1
        if not self.batches[j]:
            del self.batches[j], self.steps[j]

    def _drain_replication(self) -> None:
        for node in self.nodes:
            if node.alive and node.replicator is not None and node.replicator.error is None:
                node.replicator.flush()

    def _settle(self, timeout_s: float = 10.0) -> None:
        self._drain_replication()
        deadline = time.monotonic() + timeout_s
        while any(n.client.unsent_acks for n in self.nodes if n.alive):
            if time.monotonic() > deadline:
                raise TimeoutError("acks did not reach the controller")
            time.sleep(0.005)

    # -- failure and recovery ----------------------------------------------------

    def _kill(self, stage: int) -> None:
        log.warning("killing stage %d", stage)
        self.nodes[stage].kill()
        self.killed_at = time.perf_counter()

    def _recover(self) -> None:
        cfg = self.config
        dead = [n.stage for n in self.nodes if not n.alive]
        for s in dead:  # hot spares; they register once the controller declares s dead
            self.nodes[s] = StageNode(self, s)
        plan = {"epoch": self.epoch, "failed": []}
        while not set(dead) <= set(plan["failed"]):  # a plan made before every death was seen
            plan = self.nodes[dead[0]].client.wait_for_recovery_plan(plan["epoch"],
                                                                     cfg.plan_timeout_s)
        planned = time.perf_counter()
        failed, recompute = set(plan["failed"]), plan["recompute"] or not cfg.replicate
        resume = resume_steps(plan, sorted(self.batches), recompute)
        lengths = {
            rid: length_before(resume[j], len(self.requests[rid].prompt))
            for j, rids in self.batches.items() for rid in rids
        }
        for holder_stage, x in [] if recompute else plan["restore"]:  # step 1
            holder, new = self.nodes[holder_stage], self.nodes[x]
            sender = KVSender(holder.transport, holder.store.layout, SECRET)
            holder.transport.add_peer(new.transport.name, new.transport.metadata())
            new.caches = restore_stage(holder.store, sender, new.inbox, new.engine, lengths,
                                       cfg.kv_timeout_s)
        for node in self.nodes:  # step 4's rollback (survivors; the new stages are restored)
            if recompute or node.stage not in failed:
                rollback(node.caches, lengths)
        for j in self.batches:
            self.steps[j] = resume[j]
            for rid in self.batches[j]:
                del self.requests[rid].tokens[resume[j]:]
        if cfg.replicate:
            # Step 2, and more: every holder's replicas must match the rolled-back caches
            # (KVReceiver cannot cut a slot back), so every stage re-seeds its replicas.
            for node in self.nodes:
                for rid in node.store.held:
                    node.store.free(rid)
            self._connect(range(cfg.depth))
            for node in self.nodes:
                rids = list(node.caches)
                node.replicator.seed(rids, [node.caches[r] for r in rids])
        for node in self.nodes:
            node.client.recovered(plan["epoch"])
        self.epoch = plan["epoch"]
        if not cfg.replicate:
            log.info("restart baseline: stages %s replaced, every microbatch restarted", dead)
        elif recompute:
            log.warning("no replica survived for stages %s: recomputed from the prompts", dead)
        self.result.recoveries.append(Recovery(
            dead, self.killed_at - self.start, planned - self.killed_at,
            time.perf_counter() - planned, resume, recompute,
        ))
