"""Token-step deltas: buffered copies and streaming in parallel with compute (DejaVu §4.1).

A decode step writes one position of every layer, K/V and head of each
sequence: ``layers * 2 * heads`` small slices per sequence. ``gather_step``
packs them for a whole batch into one contiguous staging block (one copy
instead of thousands).

:class:`DeltaStreamer` ships each step's packed delta to the requests' slots
on a :class:`~orchestrator.kv.connector.KVReceiver` (for replicas or a
hand-off), as one transfer per step from a background thread: step i's delta
moves while step i+1 computes. Each sequence's step lands *contiguously* in its
slot's landing ring (one put of ``step_bytes``, not ``layers*2*heads`` small
ones; scattering a step over the slot's strided runs costs ~50x more to post
over NIXL); the receiver scatters it into the slot when it processes the
header. Step p uses landing block ``p % depth``; before reusing a block the
streamer reads (one-sided) how many positions the receiver holds, so it never
overwrites a step the receiver has not scattered, and waits, bounded, if the
receiver falls behind. The local staging ring bounds how far ``submit`` may run
ahead of the wire.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.base import KVPoll, Pair, Region, TransferHandle, Transport
from orchestrator.kv.wire import (
    BlockHeader,
    BlockKind,
    Ticket,
    crc32_of,
    encode_header,
    layout_mismatch,
)
from orchestrator.layout import KVCache, KVLayout


def gather_step(caches: Sequence[KVCache], positions: Sequence[int], out: torch.Tensor):
    """Pack position ``positions[i]`` of ``caches[i]`` into ``out``.

    Returns the packed ``[batch, layers, 2, heads, head_dim]`` view of ``out``.
    """
    layout = caches[0].layout
    shape = (len(caches), layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    packed = out.view(layout.torch_dtype)[: torch.Size(shape).numel()].view(shape)
    for i, (cache, position) in enumerate(zip(caches, positions, strict=True)):
        packed[i].copy_(cache.data[:, :, :, position])
    return packed


class DeltaStreamer:
    """Streams token-step deltas into receivers' landing rings from a background thread."""

    def __init__(
        self,
        transport: Transport,
        layout: KVLayout,
        secret: bytes,
        max_batch: int,
        depth: int = 4,
        checksum: bool = False,
        timeout_s: float = 30.0,
    ) -> None:
        self.transport, self.layout, self.secret = transport, layout, secret
        self.checksum, self.timeout_s = checksum, timeout_s
        self.max_batch = max_batch
        # A registered ring of staging blocks, each holding one step of a batch.
        self._ring = torch.empty((depth, max_batch * layout.step_bytes()), dtype=torch.uint8)
        self._ring_base = transport.register(self._ring).addr
        # Landing of a receiver's consumed-positions counter (flow control).
        self._counter = torch.zeros(1, dtype=torch.int64)
        self._counter_region = transport.register(self._counter)
        self._targets: dict[str, Ticket] = {}
        self._consumed: dict[str, int] = {}  # last known positions each receiver holds
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(depth):
            self._free.put(index)
        self._posts: queue.Queue[_Post | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self.error: KVTransferError | None = None
        self._thread = threading.Thread(target=self._run, name="kv-delta-streamer", daemon=True)
        self._thread.start()

    def add_target(self, request_id: str, ticket: bytes) -> None:
        """Send ``request_id``'s deltas to the receiver slot the ticket names."""
        decoded = Ticket.decode(ticket, self.secret)
        fields = ("first_layer", "num_layers", "num_kv_heads", "head_dim", "dtype")
        if mismatch := layout_mismatch(decoded.layout, self.layout, fields):
            raise KVTransferError(decoded.node, f"target vs streamer {mismatch}", request_id)
        if decoded.landing_depth < 1:
            raise KVTransferError(decoded.node, "ticket has no delta landing ring", request_id)
        self.transport.add_peer(decoded.node, decoded.metadata)
        self._targets[request_id] = decoded
        # The first landing_depth steps after the prompt need no check.
        self._consumed[request_id] = decoded.prompt_len

    def remove_target(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._consumed.pop(request_id, None)

    def submit(
        self, request_ids: Sequence[str], caches: Sequence[KVCache], positions: Sequence[int]
    ) -> None:
        """Pack this step's delta now (one copy); it is sent in the background."""
        self._raise_if_failed()
        if len(caches) > self.max_batch:
            raise ValueError(f"batch of {len(caches)} exceeds max_batch {self.max_batch}")
        tickets = [self._targets[rid] for rid in request_ids]
        peer = tickets[0].node
        if any(t.node != peer for t in tickets):
            raise ValueError("one submit sends to one peer; split the batch by target node")
        index = self._free_block(peer)
        packed = gather_step(caches, positions, self._ring[index])
        step = self.layout.step_bytes()
        block = self._ring_base + index * self._ring.shape[1]
        pairs = [
            (
                Region(block + i * step, step),
                Region(t.landing_addr + (pos % t.landing_depth) * step, step),
            )
            for i, (t, pos) in enumerate(zip(tickets, positions, strict=True))
        ]
        crcs = [
            crc32_of([row]) if self.checksum or t.checksum else None
            for row, t in zip(packed, tickets, strict=True)
        ]
        header = BlockHeader.for_layout(
            BlockKind.DELTA,
            "",
            self.layout,
            seq_len=max(positions),
            payload_bytes=len(caches) * step,
            batch=len(caches),
            extra=json.dumps(list(zip(request_ids, positions, crcs, strict=True))).encode(),
        )
        with self._done:
            self._pending += 1
        post = _Post(
            index,
            peer,
            pairs,
            encode_header(header, self.secret),
            list(request_ids),
            list(positions),
        )
        self._posts.put(post)

    def _free_block(self, peer: str) -> int:
        """A free staging block. The thread may hold one for a wait for room plus a
        transfer (each bounded by ``timeout_s``); if it fails meanwhile, say why."""
        deadline = time.monotonic() + 2 * self.timeout_s
        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=0.01)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise KVTransferError(
                        peer, f"staging ring full for {2 * self.timeout_s}s"
                    ) from None

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every submitted delta has landed."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._done:
            while self._pending and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError("<streamer>", f"{self._pending} deltas still in flight")
                self._done.wait(left)
        self._raise_if_failed()

    def close(self) -> None:
        """Stop the thread (after ``flush``) and unregister the staging memory."""
        self._posts.put(None)
        self._thread.join(timeout=self.timeout_s)
        self.transport.deregister(self._ring)
        self.transport.deregister(self._counter)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (post := self._posts.get()) is not None:
            try:
                if self.error is None:
                    for rid, position in zip(post.request_ids, post.positions, strict=True):
                        self._wait_for_room(post.peer, rid, position)
                    self._transfer(self.transport.write(post.peer, post.pairs, post.notify))
            except KVTransferError as error:
                self.error = self.error or error
            except Exception as error:  # never let the thread die silently: flush would hang
                self.error = self.error or KVTransferError(post.peer, repr(error))
            finally:
                self._free.put(post.index)
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _wait_for_room(self, peer: str, rid: str, position: int) -> None:
        """Block until the receiver scattered the step that used ``position``'s landing block."""
        ticket = self._targets.get(rid)
        if ticket is None:  # removed while this post was queued: the request has ended
            return
        deadline = time.monotonic() + self.timeout_s
        consumed = self._consumed.get(rid, ticket.prompt_len)
        while position - consumed >= ticket.landing_depth:
            remote = Region(ticket.consumed_addr, self._counter.element_size())
            self._transfer(self.transport.read(peer, [(self._counter_region, remote)]))
            consumed = int(self._counter[0])
            if rid in self._targets:  # not removed meanwhile
                self._consumed[rid] = consumed
            if position - consumed < ticket.landing_depth:
                return
            if time.monotonic() > deadline:
                raise KVTransferError(
                    peer,
                    f"receiver holds {consumed} positions of "
                    f"{rid!r} after {self.timeout_s}s; it must call progress() "
                    f"for step {position} to land",
                    rid,
                )
            time.sleep(0.0002)

    def _transfer(self, handle: TransferHandle) -> None:
        """Wait for one transfer (bounded); raises naming the peer."""
        start = time.monotonic()
        while (state := self.transport.poll(handle)) == KVPoll.TRANSFERRING:
            if time.monotonic() - start > self.timeout_s:
                raise KVTransferError(handle.peer, f"transfer unfinished after {self.timeout_s}s")
            time.sleep(0.00005)
        if state == KVPoll.FAILED:
            raise KVTransferError(handle.peer, handle.error or "transfer failed")


@dataclass
class _Post:
    index: int  # staging block
    peer: str
    pairs: list[Pair]
    notify: bytes
    request_ids: list[str]
    positions: list[int]
