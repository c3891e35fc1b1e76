"""Token-step deltas: buffered copies and streaming in parallel with compute (DejaVu §4.1).

A decode step writes one position of every layer, K/V and head of each
sequence: ``layers * 2 * heads`` small slices per sequence. ``gather_step``
packs them for a whole batch into one contiguous staging block (one copy
instead of thousands), and ``scatter_step`` unpacks on the other side.

:class:`DeltaStreamer` ships each step's packed delta into the slots a
:class:`~orchestrator.kv.connector.KVReceiver` reserved for the same requests
(for replicas or a hand-off), as one transfer per step, from a background
thread: step i's delta moves while step i+1 computes. The ring of staging
blocks bounds how far the sender may run ahead; ``submit`` blocks (with a
timeout) when the ring is full.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Sequence

import torch

from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.layout import KVCache, KVLayout
from orchestrator.kv.primitives import kv_spans, pair_spans
from orchestrator.kv.transport.base import KVPoll, Region, Transport
from orchestrator.kv.wire import (
    BlockHeader,
    BlockKind,
    Ticket,
    crc32_of,
    encode_header,
    layout_mismatch,
)


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


def scatter_step(packed: torch.Tensor, caches: Sequence[KVCache], positions: Sequence[int]):
    """Inverse of :func:`gather_step`."""
    for i, (cache, position) in enumerate(zip(caches, positions, strict=True)):
        cache.data[:, :, :, position].copy_(packed[i])


class DeltaBuffer:
    """A registered ring of staging blocks, each holding one step of a batch."""

    def __init__(self, transport: Transport, layout: KVLayout, max_batch: int, depth: int):
        self.layout, self.max_batch = layout, max_batch
        self.ring = torch.empty((depth, max_batch * layout.step_bytes()), dtype=torch.uint8)
        self.base = transport.register(self.ring).addr

    def region(self, index: int, nbytes: int) -> Region:
        return Region(self.base + index * self.ring.shape[1], nbytes)


class DeltaStreamer:
    """Streams token-step deltas to reserved receiver slots from a background thread."""

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
        self.buffer = DeltaBuffer(transport, layout, max_batch, depth)
        self._targets: dict[str, Ticket] = {}
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(depth):
            self._free.put(index)
        self._posts: queue.Queue[tuple[int, str, list, bytes] | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self.error: KVTransferError | None = None
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-delta-streamer", daemon=True)
        self._thread.start()

    def add_target(self, request_id: str, ticket: bytes) -> None:
        """Send ``request_id``'s deltas into the slot its receiver reserved."""
        decoded = Ticket.decode(ticket, self.secret)
        fields = ("first_layer", "num_layers", "num_kv_heads", "head_dim", "dtype")
        if mismatch := layout_mismatch(decoded.layout, self.layout, fields):
            raise KVTransferError(decoded.node, f"target vs streamer {mismatch}", request_id)
        self.transport.add_peer(decoded.node, decoded.metadata)
        self._targets[request_id] = decoded

    def remove_target(self, request_id: str) -> None:
        self._targets.pop(request_id, None)

    def submit(
        self, request_ids: Sequence[str], caches: Sequence[KVCache], positions: Sequence[int]
    ) -> None:
        """Pack this step's delta now; it is sent in the background."""
        self._raise_if_failed()
        tickets = [self._targets[rid] for rid in request_ids]
        peer = tickets[0].node
        if any(t.node != peer for t in tickets):
            raise ValueError("one submit sends to one peer; split the batch by target node")
        try:
            index = self._free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise KVTransferError(peer, f"delta ring full for {self.timeout_s}s") from None
        packed = gather_step(caches, positions, self.buffer.ring[index])
        nbytes = packed.numel() * packed.element_size()
        remote = [
            span
            for ticket, position in zip(tickets, positions, strict=True)
            for span in kv_spans(
                ticket.layout,
                ticket.slot_addr,
                ticket.layout.layer_range,
                range(position, position + 1),
            )
        ]
        header = BlockHeader.for_layout(
            BlockKind.DELTA,
            "",
            self.layout,
            seq_len=max(positions),
            payload_bytes=nbytes,
            crc32=crc32_of([packed]) if self.checksum else None,
            batch=len(caches),
            extra=json.dumps(list(zip(request_ids, positions, strict=True))).encode(),
        )
        pairs = pair_spans([self.buffer.region(index, nbytes)], remote)
        with self._done:
            self._pending += 1
        self._posts.put((index, peer, pairs, encode_header(header, self.secret)))

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
        """Stop the thread (after ``flush``) and unregister the ring."""
        self._posts.put(None)
        self._thread.join(timeout=self.timeout_s)
        self.transport.deregister(self.buffer.ring)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (item := self._posts.get()) is not None:
            index, peer, pairs, notify = item
            try:
                self._send(peer, pairs, notify)
            except KVTransferError as error:
                self.error = self.error or error
            finally:
                self._free.put(index)
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _send(self, peer: str, pairs: list, notify: bytes) -> None:
        if self.error is not None:
            return
        handle = self.transport.write(peer, pairs, notify)
        start = time.monotonic()
        while (state := self.transport.poll(handle)) == KVPoll.TRANSFERRING:
            if time.monotonic() - start > self.timeout_s:
                raise KVTransferError(peer, f"delta transfer unfinished after {self.timeout_s}s")
            time.sleep(0.0001)
        if state == KVPoll.FAILED:
            raise KVTransferError(peer, handle.error or "delta transfer failed")
        self.bytes_sent += handle.nbytes
