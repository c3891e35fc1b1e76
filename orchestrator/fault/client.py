"""The node side of the controller: registration, a heartbeat thread, acks, recovery reports.

Nothing on the serving path waits for the controller: ``ack`` only records the
step, and the heartbeat thread sends the acks recorded since its last beat.
When the controller is unreachable the node keeps serving and keeps its acks;
failures in that window go undetected until the controller returns. A
restarted controller knows nobody: on its first ``NOT_FOUND`` the client
registers again and re-sends every ack it holds, which rebuilds the state.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from orchestrator.fault.rpc import Stub
from orchestrator.pipeline import HEARTBEAT_S

log = logging.getLogger("dejavu.fault.client")


def query_status(controller: str | Stub, secret: bytes = b"", timeout_s: float = 2.0) -> dict:
    """The controller's view of the cluster (nodes, pipelines, acks), for ``dejavu status``;
    ``controller``: a kept :class:`Stub` (callers that poll), or an address and the secret (a
    channel for this call only)."""
    if isinstance(controller, Stub):
        return controller.call("Status", {}, timeout_s)
    stub = Stub(controller, secret)
    try:
        return stub.call("Status", {}, timeout_s)
    finally:
        stub.close()


def report_lost(controller: str | Stub, node_id: str, why: str, secret: bytes = b"",
                timeout_s: float = 1.0) -> bool:
    """Tell the controller that node ``node_id``'s process is gone (its caller saw it end):
    it is declared dead at once (a node it does not know is left alone). False if the
    controller could not be told (its heartbeat timeout still finds the node)."""
    stub = controller if isinstance(controller, Stub) else Stub(controller, secret)
    try:
        stub.call("Lost", {"node_id": node_id, "why": why}, timeout_s)
        return True
    except grpc.RpcError as e:
        log.warning("could not report %s lost: %s", node_id, e.code())
        return False
    finally:
        if stub is not controller:
            stub.close()


@dataclass(frozen=True)
class NodeSpec:
    pipeline: str
    stage: int
    depth: int
    role: str = "token"
    address: str = ""  # where peers reach the node's service (Triton URL)


class ControllerClient:
    def __init__(
        self,
        controller: str,
        spec: NodeSpec,
        secret: bytes,
        heartbeat_s: float = HEARTBEAT_S,
        rpc_timeout_s: float = 1.0,
        node_id: str | None = None,
        ack_interval_s: float = 0.01,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """``alive``: whether the process this node serves in still runs; the beats stop
        once it does not (a Python-backend stub can outlive its tritonserver, and must not
        keep a dead node alive to the controller)."""
        if min(heartbeat_s, rpc_timeout_s, ack_interval_s) <= 0:
            raise ValueError("heartbeat_s, rpc_timeout_s and ack_interval_s must be > 0")
        self.spec, self.alive = spec, alive
        self.node_id = node_id or f"{spec.pipeline}/{spec.stage}/{uuid.uuid4().hex[:8]}"
        self.heartbeat_s, self.rpc_timeout_s = heartbeat_s, rpc_timeout_s
        # Acks go out sooner than beats: the unsent ones die with the node.
        self.ack_interval_s = min(ack_interval_s, heartbeat_s)
        self.epoch, self.state = 0, "unknown"  # of the pipeline, as of the last beat
        self.connected = False
        self._stub = Stub(controller, secret)
        self._registered = False
        self._beats = 0  # heartbeats sent: each carries the next number
        self._rejoin = False  # registered before, with a controller that forgot it since
        self._warned = False  # "unreachable" logged since the last contact
        # Told the node ids whose processes ended (a T-node frees the KV slots they would
        # have written), as the beats bring them; ``_ended_seen``: how many it was told.
        self.on_ended: Callable[[list[str]], None] | None = None
        self._ended_seen = 0
        self._acks: dict[tuple[int, int], int] = {}  # (source stage, microbatch) -> step
        self._unsent: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set by an ack: the thread sleeps until a beat is due or an ack is made (a thread
        # waking every ack interval costs the token loop on its core a switch each time).
        self._acked = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.node_id}",
                                        daemon=True)

    def start(self) -> ControllerClient:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating (a crash looks the same to the controller) and close the channel."""
        self._stop.set()
        self._acked.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._stub.close()

    # -- the serving path --------------------------------------------------

    def ack(self, source_stage: int, microbatch: int, step: int) -> None:
        """This node holds ``source_stage``'s KV of ``microbatch`` through ``step``."""
        key = (source_stage, microbatch)
        with self._lock:
            if step > self._acks.get(key, -1):
                self._acks[key] = step
                self._unsent.add(key)
        self._acked.set()

    def recovered(self, epoch: int) -> None:
        """This node carried out plan ``epoch``; its replicas restart from the resume point."""
        with self._lock:  # the controller rolled the acks back; redone steps ack again
            self._acks.clear()
            self._unsent.clear()
        reply = self._call("Recovered", {"node_id": self.node_id, "epoch": epoch})
        self.epoch, self.state = reply["epoch"], reply["state"]

    def suspect(self, stage: int) -> None:
        """This node's transport lost its connection to ``stage`` of its pipeline: the
        controller checks at once whether that node is gone (in a thread of its own: the
        caller is on the serving path)."""
        threading.Thread(target=self._suspect, args=(stage,), daemon=True,
                         name=f"suspect-{stage}").start()

    def _suspect(self, stage: int) -> None:
        try:
            reply = self._call("Suspect", {"node_id": self.node_id, "stage": stage})
            if reply["dead"]:
                log.warning("%s: stage %d is gone (the controller confirmed it)",
                            self.node_id, stage)
        except grpc.RpcError as e:  # the heartbeat timeout still finds it
            log.warning("%s: could not report stage %d: %s", self.node_id, stage, e.code())

    def lost(self, why: str) -> None:
        """This node cannot serve any more (a process of it ended): dead now, not after the
        heartbeat timeout."""
        if self._registered:
            report_lost(self._stub, self.node_id, why, timeout_s=self.rpc_timeout_s)

    # -- the heartbeat thread -------------------------------------------------

    def _call(self, method: str, request: dict) -> dict:
        return self._stub.call(method, request, self.rpc_timeout_s)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if not self.alive():
                log.error("%s: the process it serves in is gone; no more heartbeats",
                          self.node_id)
                self.lost("the process it served in ended")
                return
            now = time.monotonic()
            beat = now >= next_beat
            if beat:
                next_beat = now + self.heartbeat_s
            if beat or (self.connected and self._unsent):
                self._beat(beat)
            if self._acked.wait(max(0.0, next_beat - time.monotonic())):
                self._acked.clear()
                self._stop.wait(self.ack_interval_s)  # the acks made meanwhile go together

    def _beat(self, heartbeat: bool) -> None:
        try:
            if not self._registered:
                self._register()
            if heartbeat:
                self._beats += 1  # the controller refuses a number it has seen
                reply = self._call("Heartbeat", {"node_id": self.node_id, "seq": self._beats,
                                                 "ended_seen": self._ended_seen})
                self.epoch, self.state = reply["epoch"], reply["state"]
                if self.on_ended is not None:  # none yet: the next beats ask again
                    self._ended_seen = reply["ended_seen"]
                    if reply["ended"]:
                        self.on_ended(reply["ended"])
            self._flush_acks()
            if not self.connected:
                log.info("%s: connected to the controller", self.node_id)
            self.connected, self._warned = True, False
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                log.warning("%s: the controller forgot this node (restarted); re-registering",
                            self.node_id)
                self._registered, self._rejoin = False, True
            elif code == grpc.StatusCode.ALREADY_EXISTS:
                # A spare waiting for the controller to declare the old holder dead.
                log.debug("%s: %s; retrying", self.node_id, e.details())
            elif code == grpc.StatusCode.FAILED_PRECONDITION:
                log.error("%s: the controller declared this node dead", self.node_id)
                self._stop.set()
            elif self.connected or not self._warned:
                log.warning("%s: controller unreachable (%s); serving goes on, failures "
                            "go undetected until it returns", self.node_id, code)
                self._warned = True
            self.connected = False

    def _register(self) -> None:
        spec = self.spec
        reply = self._call("Register", {
            "node_id": self.node_id, "role": spec.role, "pipeline": spec.pipeline,
            "stage": spec.stage, "depth": spec.depth, "address": spec.address,
            "rejoin": self._rejoin,
        })
        self.epoch, self.state = reply["epoch"], reply["state"]
        self._registered = True
        with self._lock:
            self._unsent = set(self._acks)  # a new controller has none of them

    def _flush_acks(self) -> None:
        """Send the unsent acks; they stay unsent until the controller has them (a failed
        call leaves them for the next beat)."""
        with self._lock:
            batch = [[s, j, self._acks[(s, j)]] for (s, j) in sorted(self._unsent)]
        if not batch:
            return
        self._call("Ack", {"node_id": self.node_id, "acks": batch})
        with self._lock:  # a later step acked meanwhile is still to send
            self._unsent.difference_update(
                (s, j) for s, j, step in batch if self._acks.get((s, j)) == step)
