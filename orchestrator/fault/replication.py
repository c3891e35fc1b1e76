"""KV replicas on the next stage: stage x streams its KV to stage (x+1)%D's host memory.

Built from the KV library, nothing re-implemented: the holder's
:class:`ReplicaStore` is a :class:`~orchestrator.kv.connector.KVReceiver` pool
(one slot per replicated request); a request's existing KV (its prompt, or a
whole cache during recovery) goes over :class:`~orchestrator.kv.connector.KVSender`
layer by layer, and each token step's delta over the buffered
:class:`~orchestrator.kv.delta.DeltaStreamer`, in the background while the next
step computes.

Acks: once the streamer reports every delta up to step t of microbatch j
landed (a one-sided WRITE complete at the initiator has put the bytes in the
holder's memory: NIXL/UCX semantics), the source tells the holder, and the
*holder* acks ``(x, j, t)`` to the controller, as in the paper: the acks of a
dead stage live on with its holder. An ack that is late or lost only makes
recovery redo more steps, never fewer.

The source reaches the holder through a :class:`ReplicaPeer` (``open`` a slot
and get a ticket, ``free`` it, ``landed``): in a deployment the holder is
another process (:class:`~orchestrator.fault.node_replication.RemoteReplicaPeer`);
a :class:`ReplicaStore` is one itself, which the unit tests use in one process.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.delta import DeltaStreamer
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.base import Transport
from orchestrator.layout import KVCache, KVLayout

log = logging.getLogger("dejavu.fault.replication")

AckFn = Callable[[int, int, int], None]  # (source stage, microbatch, step)


class ReplicaPeer(Protocol):
    """The holder as the source sees it."""

    def open(self, request_id: str, length: int) -> bytes:
        """Reserve a replica slot; the ticket the source writes ``length`` positions with."""
        ...

    def free(self, request_id: str) -> None: ...

    def landed(self, source_stage: int, microbatch: int, step: int) -> None:
        """Every delta of ``microbatch`` through ``step`` is in the holder's memory."""
        ...


class ReplicaStore:
    """Holder side: replicas of one source stage's KV in registered host memory."""

    def __init__(
        self,
        transport: Transport,
        source_layout: KVLayout,
        num_slots: int,
        secret: bytes,
        ack: AckFn | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.layout, self.ack = source_layout, ack
        self.receiver = KVReceiver(transport, source_layout, num_slots, secret, timeout_s)
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def open(self, request_id: str, length: int) -> bytes:
        with self._lock:
            if request_id in self._held:  # re-seeded after a recovery: start over
                self.receiver.release(request_id)
            ticket = self.receiver.reserve(request_id, length)
            self._held.add(request_id)
            return ticket

    def free(self, request_id: str) -> None:
        with self._lock:
            self._held.discard(request_id)
            self.receiver.release(request_id)

    def landed(self, source_stage: int, microbatch: int, step: int) -> None:
        if self.ack is not None:
            self.ack(source_stage, microbatch, step)

    def progress(self) -> None:
        """Scatter the deltas that landed; the holding stage calls it once per step."""
        self.receiver.progress()

    def replica(self, request_id: str, length: int) -> KVCache:
        """The replica as a cache view of its first ``length`` positions."""
        self.receiver.wait(request_id)  # its first part (prompt, or a seed) is complete
        cache = self.receiver.cache(request_id)
        if cache.length < length:
            raise RuntimeError(
                f"replica of {request_id!r} holds {cache.length} positions, {length} needed"
            )
        return KVCache(self.layout, cache.data, length)

    @property
    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)


def send_cache(sender: KVSender, request_id: str, cache: KVCache, ticket: bytes,
               timeout_s: float) -> None:
    """Send ``cache``'s first ``cache.length`` positions, layer by layer, to ``ticket``."""
    handle = sender.start(request_id, [ticket])
    first = cache.layout.first_layer
    for layer in range(first, first + cache.layout.num_layers):
        sender.save_layer(handle, layer, cache)
    sender.finish(handle)
    sender.wait_for_save(handle, timeout_s)


class Replicator:
    """Source side: replicates one stage's requests to its holder and acks each step.

    The stage calls :meth:`step` after computing step t of microbatch j, and
    :meth:`remove` when a request ends. A request ``step`` has not seen yet is
    replicated whole first (its prompt; after a recovery, everything so far), and so is
    one whose step wrote more than one position (the next chunk of a chunked prompt).
    If the holder fails, replication stops (logged) until a recovery builds a
    new ``Replicator``: the controller learns of the failure from heartbeats.
    """

    def __init__(
        self,
        stage: int,
        transport: Transport,
        layout: KVLayout,
        secret: bytes,
        holder: ReplicaPeer,
        max_batch: int,
        timeout_s: float = 10.0,
    ) -> None:
        self.stage, self.holder, self.timeout_s = stage, holder, timeout_s
        self.sender = KVSender(transport, layout, secret)
        self.streamer = DeltaStreamer(transport, layout, secret, max_batch, timeout_s=timeout_s)
        self.error: KVTransferError | None = None
        self._sent: dict[str, int] = {}  # request id -> KV positions replicated
        # Landed steps to ack, ended requests to free, flush markers, in submission order.
        self._steps: queue.Queue[tuple[int, int] | str | threading.Event | None] = queue.Queue()
        self._acker = threading.Thread(target=self._ack_landed, name=f"acks-{stage}", daemon=True)
        self._acker.start()

    def step(self, microbatch: int, step: int, request_ids: Sequence[str],
             caches: Sequence[KVCache]) -> None:
        """Replicate what step ``step`` of ``microbatch`` wrote; ack once it landed."""
        if self.error is not None:
            return
        try:
            # One new position: a token step's delta. More (a chunk of a prompt on top of its
            # earlier chunks): the request is sent whole again, as a new one is.
            old = [(rid, c) for rid, c in zip(request_ids, caches, strict=True)
                   if self._sent.get(rid) == c.length - 1]
            whole = [(rid, c) for rid, c in zip(request_ids, caches, strict=True)
                     if self._sent.get(rid) != c.length - 1]
            if whole:
                self.seed(*zip(*whole, strict=True))
            if old:
                ids, held = zip(*old, strict=True)
                self.streamer.submit(ids, held, [c.length - 1 for c in held])
                self._sent.update({rid: c.length for rid, c in old})
        except KVTransferError as error:
            self._broken(error)
            return
        self._steps.put((microbatch, step))

    def seed(self, request_ids: Sequence[str], caches: Sequence[KVCache]) -> None:
        """Replicate these requests' KV so far, whole (a prompt, or recovery step 2)."""
        for rid, cache in zip(request_ids, caches, strict=True):
            ticket = self.holder.open(rid, cache.length)
            send_cache(self.sender, rid, cache, ticket, self.timeout_s)
            self.streamer.add_target(rid, ticket)
            self._sent[rid] = cache.length

    def remove(self, request_id: str) -> None:
        """The request ended: stop streaming it and free its replica, after its last delta."""
        if self._sent.pop(request_id, None) is not None:
            self._steps.put(request_id)

    def _free(self, request_id: str) -> None:
        self.streamer.remove_target(request_id)
        if self.error is not None:
            return  # a dead holder's memory is gone with it
        try:
            self.holder.free(request_id)
        except Exception as error:
            log.warning("stage %d: freeing the replica of %s failed: %s", self.stage,
                        request_id, error)

    def flush(self) -> None:
        """Wait until every step so far has landed and been acked (tests, shutdown)."""
        if not self._acker.is_alive():
            raise RuntimeError(f"stage {self.stage}: the replicator is closed")
        done = threading.Event()
        self._steps.put(done)
        if not done.wait(self.timeout_s):
            raise TimeoutError(f"stage {self.stage}: replication not flushed in {self.timeout_s}s")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._steps.put(None)
        self._acker.join(timeout=self.timeout_s)
        self.streamer.close()

    def _broken(self, error: KVTransferError) -> None:
        if self.error is None:
            log.warning("stage %d: replication to its holder failed, stopped: %s",
                        self.stage, error)
        self.error = error

    def _ack_landed(self) -> None:
        """Flush the streamer, then handle every item queued before the flush began."""
        while (item := self._steps.get()) is not None:
            batch = [item]
            while not self._steps.empty():
                batch.append(self._steps.get())
            try:
                self.streamer.flush(self.timeout_s)
            except KVTransferError as error:
                self._broken(error)
            for entry in batch:
                if entry is None:
                    return
                if isinstance(entry, threading.Event):
                    entry.set()
                elif isinstance(entry, str):
                    self._free(entry)
                elif self.error is None:
                    try:
                        self.holder.landed(self.stage, *entry)
                    except Exception as error:  # the holder is gone: replicate no more
                        self._broken(KVTransferError("replica holder", f"ack: {error}"))
