"""KV replicas across processes: a :class:`~orchestrator.pipeline.node.StageNode` streams each
step's KV delta to stage (x+1)%D's host memory and holds stage (x-1)%D's.

The same :class:`~orchestrator.fault.replication.Replicator` and
:class:`~orchestrator.fault.replication.ReplicaStore` as the in-process
pipeline; only the holder's small control calls (``open`` a slot and get its
ticket, ``free`` it, ``landed``) cross processes, over gRPC
(:class:`ReplicaServer` / :class:`RemoteReplicaPeer`). The bytes go over a
third NIXL endpoint of the node (``<name>-replica``), apart from its ring and
prompt-KV endpoints since each drains its own notifications.

Bootstrap, after ``node.connect`` and before ``node.start`` (the coordinator
carries the opaque bytes, as for the node's own endpoints)::

    replication = NodeReplication(node, secret=b"...")
    mine = replication.endpoints()
    replication.connect(next=endpoints[(i + 1) % depth], previous=endpoints[(i - 1) % depth])

It plugs into the node's stage worker through its hooks only (``on_step``:
replicate, then take in the deltas that landed here; ``on_release``: free the
replica). Acks ``(x, j, t)`` come out of the holder's ``ack`` callback (a
:class:`~orchestrator.fault.client.ControllerClient`'s ``ack`` in a deployment).

Replacing a lost stage uses ``reconnect``, ``restore`` (on the holder: step 1),
``adopt``, ``rollback`` and ``reseed``, as control requests across Triton nodes; their
order is :mod:`orchestrator.fault.stage_recovery`'s.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from concurrent import futures

import grpc

from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.fault.replication import AckFn, ReplicaStore, Replicator, send_cache
from orchestrator.fault.rpc import RequestError, Stub, service_handler
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.base import KVPoll, Transport
from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.node import StageNode


class ReplicaServer:
    """The holder's control calls as a gRPC service on an ephemeral port of ``host`` (the
    node's own host as its peers reach it: loopback locally, a service name in containers).

    Two pools answer ``ReplicaOpen``: ``replica`` (the predecessor's replicas) and, on a
    replacement stage during recovery, ``landing`` (its own KV, sent back by its holder).
    """

    def __init__(self, landing: ReplicaStore, secret: bytes, host: str = "127.0.0.1") -> None:
        self.store: ReplicaStore | None = None  # set once the source's layout is known
        self.landing = landing
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((service_handler({
            "ReplicaOpen": self._open, "ReplicaFree": self._free, "ReplicaLanded": self._landed,
        }, secret),))
        # Only on the node's own host (a container's service name resolves to its address).
        port = self._server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{port}"
        self._server.start()

    def _store(self) -> ReplicaStore:
        if self.store is None:
            raise RequestError("this node holds no replicas yet (connect() not called)",
                               grpc.StatusCode.FAILED_PRECONDITION)
        return self.store

    def _open(self, request: dict) -> dict:
        store = self.landing if request.get("pool") == "landing" else self._store()
        ticket = store.open(str(request["request_id"]), int(request["length"]))
        return {"ticket": base64.b64encode(ticket).decode()}

    def _free(self, request: dict) -> dict:
        self._store().free(str(request["request_id"]))
        return {}

    def _landed(self, request: dict) -> dict:
        store = self._store()
        store.progress()  # scatter what landed now, so the source's delta ring never fills
        store.landed(int(request["stage"]), int(request["microbatch"]), int(request["step"]))
        return {}

    def close(self) -> None:
        self._server.stop(grace=None)


class RemoteReplicaPeer:
    """A :class:`~orchestrator.fault.replication.ReplicaPeer` in another process."""

    def __init__(self, address: str, secret: bytes, timeout_s: float,
                 pool: str = "replica") -> None:
        self._stub, self.timeout_s, self.pool = Stub(address, secret), timeout_s, pool

    def open(self, request_id: str, length: int) -> bytes:
        answer = self._stub.call("ReplicaOpen", {"request_id": request_id, "length": length,
                                                 "pool": self.pool}, self.timeout_s)
        return base64.b64decode(answer["ticket"])

    def free(self, request_id: str) -> None:
        self._stub.call("ReplicaFree", {"request_id": request_id}, self.timeout_s)

    def landed(self, source_stage: int, microbatch: int, step: int) -> None:
        self._stub.call("ReplicaLanded", {"stage": source_stage, "microbatch": microbatch,
                                          "step": step}, self.timeout_s)

    def close(self) -> None:
        self._stub.close()


class NodeReplication:
    """One stage node's replicas: its own KV streamed to its successor, its predecessor's held."""

    def __init__(
        self,
        node: StageNode,
        secret: bytes,
        *,
        make_transport: Callable[[str], Transport] | None = None,
        ack: AckFn | None = None,
        slots: int | None = None,
        timeout_s: float = 10.0,
        host: str = "127.0.0.1",
    ) -> None:
        """``ack``: called on the holder for every ``(source stage, microbatch, step)`` whose
        deltas all landed here. ``slots``: replicas held at once (default: every sequence the
        pipeline can run, plus its prompt slots). ``host``: where peers reach this node."""
        if node.config.depth < 2:
            raise ValueError("replication needs a pipeline of depth >= 2")
        if make_transport is None:
            from orchestrator.kv.transport.nixl import NixlTransport

            make_transport = NixlTransport
        config = node.config
        self.node, self.secret, self.timeout_s = node, secret, timeout_s
        self.slots = slots or config.microbatches * config.batch_size + config.prompt_slots
        self.transport = make_transport(f"{node.name}-replica")
        self.ack = ack  # set later by a spare that prepared its stage on standby
        # Where this stage's own KV lands when its holder restores it (recovery step 1).
        self.landing = ReplicaStore(self.transport, node.engine.kv_layout, self.slots, secret,
                                    timeout_s=timeout_s)
        self.server = ReplicaServer(self.landing, secret, host)
        self.replicator: Replicator | None = None
        self._peer: RemoteReplicaPeer | None = None
        self._holder_node = ""  # the successor's replica endpoint

    @property
    def store(self) -> ReplicaStore | None:
        """Replicas of stage (x-1)%D held here."""
        return self.server.store

    def endpoints(self) -> bytes:
        return json.dumps({
            "stage": self.node.index, "address": self.server.address,
            "node": self.transport.name,
            "metadata": base64.b64encode(self.transport.metadata()).decode(),
            "layout": self.node.engine.kv_layout.to_dict(),
        }).encode()

    def connect(self, next: bytes, previous: bytes) -> None:  # noqa: A002  (StageNode's word)
        """Replicate to the successor's endpoints; hold the predecessor's replicas (after
        ``node.connect``)."""
        if self.node.worker is None:
            raise RuntimeError(f"stage {self.node.index}: node.connect() before replicating")
        succ = self._endpoints_of("next", next, 1)
        pred = self._endpoints_of("previous", previous, -1)
        self.hold(KVLayout(**pred["layout"]))
        self.server.store.ack = self.ack
        self._replicate_to(succ)
        worker = self.node.worker
        assert worker is not None
        worker.on_step, worker.on_release = self._on_step, self._on_release

    def hold(self, previous: KVLayout) -> None:
        """Make the store of the predecessor's replicas now (a spare on standby: not while a
        pipeline waits for it); ``connect`` keeps it if the predecessor's layout is this."""
        store = self.server.store
        if store is None or store.layout != previous:
            self.server.store = ReplicaStore(self.transport, previous, self.slots, self.secret,
                                             self.ack, self.timeout_s)
            if store is not None:
                store.receiver.close()

    def reconnect(self, next: bytes) -> None:  # noqa: A002
        """The successor was replaced: replicate to the new one from now on. Between steps
        (with ``StageNode.reconnect``); requests running now are seeded there whole at their
        next step, as a new request's prompt is."""
        if self.replicator is None or self._peer is None:
            raise RuntimeError(f"stage {self.node.index}: connect() before reconnect()")
        succ = self._endpoints_of("next", next, 1)
        self.replicator.close()
        self._peer.close()
        if self._holder_node != succ["node"]:
            self.transport.remove_peer(self._holder_node)
        self._replicate_to(succ)

    def _endpoints_of(self, what: str, endpoints: bytes, offset: int) -> dict:
        """Parse a neighbour's endpoints; it must be stage (x + offset) % D."""
        got = json.loads(endpoints)
        want = (self.node.index + offset) % self.node.config.depth
        if got["stage"] != want:
            raise ValueError(f"stage {self.node.index}: {what} replication endpoints are of "
                             f"stage {got['stage']}, expected {want}")
        return got

    def _replicate_to(self, succ: dict) -> None:
        self.transport.add_peer(succ["node"], base64.b64decode(succ["metadata"]))
        self._holder_node = succ["node"]
        self._peer = RemoteReplicaPeer(succ["address"], self.secret, self.timeout_s)
        self.replicator = self._new_replicator()

    def _new_replicator(self) -> Replicator:
        assert self._peer is not None
        return Replicator(self.node.index, self.transport, self.node.engine.kv_layout,
                          self.secret, self._peer, self.node.config.batch_size, self.timeout_s)

    # -- recovery ------------------------------------------------------------------------

    def restore(self, to: bytes, lengths: dict[str, int]) -> None:
        """Recovery step 1, on the holder: send the predecessor's replicas, ``lengths``
        positions each, to its replacement (``to``: the replacement's endpoints())."""
        assert self.store is not None
        new = self._endpoints_of("previous", to, -1)
        self.transport.add_peer(new["node"], base64.b64decode(new["metadata"]))
        landing = RemoteReplicaPeer(new["address"], self.secret, self.timeout_s,
                                    pool="landing")
        sender = KVSender(self.transport, self.store.layout, self.secret)
        self.store.progress()  # take in the deltas that landed since this stage's last step
        try:
            for rid, length in lengths.items():
                send_cache(sender, rid, self.store.replica(rid, length),
                           landing.open(rid, length), self.timeout_s)
        finally:
            landing.close()

    def adopt(self, lengths: dict[str, int],
              sampling: dict[int, SamplingParams] | None = None) -> None:
        """On the replacement, before it starts: take the restored KV into the stage (and,
        on the last stage, the sequences' samplers)."""
        worker = self.node.worker
        assert worker is not None
        for rid, length in lengths.items():
            cache = self.node.engine.new_cache()
            cache.data.copy_(self.landing.replica(rid, length).data)
            cache.length = length
            self.landing.free(rid)
            self.node.kv.add(int(rid), cache)
        if worker.is_last:
            worker.samplers.update({s: Sampler(p) for s, p in (sampling or {}).items()})

    def rollback(self, lengths: dict[int, int]) -> None:
        """Recovery step 4 on a surviving stage, paused: cut its KV back to ``lengths`` (the
        rest is dropped) and forget the replicas held here, which :meth:`reseed` replaces."""
        self.node.kv.rollback(lengths)
        if self.store is not None:
            for rid in self.store.held:
                self.store.free(rid)

    def reseed(self) -> None:
        """After every stage's :meth:`rollback`: replicate this stage's KV whole to its
        holder (recovery step 2 for the predecessor of a replaced stage, and how every
        other replica loses the steps cut back), then stream deltas on from there."""
        assert self.replicator is not None
        self.replicator.close()
        self.replicator = self._new_replicator()
        held = self.node.kv.held()
        self.replicator.seed([str(s) for s in held], list(held.values()))

    # -- the stage hooks (on the stage worker's thread) -----------------------------------

    def _on_step(self, microbatch: int, step: int, seq_ids: list[int],
                 caches: list[KVCache]) -> None:
        assert self.replicator is not None and self.store is not None
        self.replicator.step(microbatch, step, [str(s) for s in seq_ids], caches)
        self.store.progress()

    def _on_release(self, seq_id: int) -> None:
        assert self.replicator is not None
        self.replicator.remove(str(seq_id))

    # -- checks -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every step so far landed on the successor and was acked there."""
        assert self.replicator is not None
        self.replicator.flush()

    def replica_lengths(self) -> dict[str, int]:
        """Each replica held here (by sequence id) and the KV positions it holds now."""
        if self.store is None:
            return {}
        self.store.progress()  # take in the deltas that landed since this stage's last step
        receiver = self.store.receiver
        return {rid: receiver.cache(rid).length for rid in self.store.held
                if receiver.poll(rid) is KVPoll.SUCCESS}  # a seed still landing: not kept

    def held(self) -> list[str]:
        """Sequence ids (as strings) whose replicas this node holds."""
        return [] if self.store is None else self.store.held

    def held_counts(self) -> dict[str, int]:
        """Replicas held here, and restored KV not yet adopted."""
        return {"replicas": len(self.held()), "landing": len(self.landing.held)}

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()
        if self._peer is not None:
            self._peer.close()
        self.server.close()
        for store in (self.store, self.landing):
            if store is not None:
                store.receiver.close()
        self.transport.close()
