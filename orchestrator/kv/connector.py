"""The API prefill (P) and decode (T) nodes call to move a prompt's KV cache.

Decode node (owns a registered pool of KV slots in host memory)::

    receiver = KVReceiver(transport, layout, num_slots, secret)
    ticket = receiver.reserve(request_id, prompt_len)   # bytes; send to the P node(s)
    cache, extra = receiver.wait(request_id)            # KVCache view of the slot, sender's extra
    ...decode with ``cache``...
    receiver.release(request_id)                        # also after an error or a cancel

A reservation nobody uses expires (``reserve_ttl_s``): one that no ``poll``, ``wait``
or ``cache`` asked about is dropped once its ticket expires, and the ticket's
deadline (signed, in it) stops any sender writing with it after that, so the slot
is free again after a short grace for a write posted just before the deadline.

Prefill node (one ticket per token stage; layers are routed to the stage that holds them)::

    sender = KVSender(transport, layout, secret)
    handle = sender.start(request_id, tickets)
    engine.prefill(..., on_layer=lambda l, caches: sender.save_layer(handle, l, caches[i]))
    sender.finish(handle, extra=first_token_bytes)
    sender.wait_for_save(handle, timeout_s=10)          # raises KVTransferError naming the peer

How it moves: ``save_layer`` packs the prompt positions of one layer into a
registered staging block and posts one WRITE of it into the receiver's slot
(scattered over the slot's strided runs); the block's checked header
(:mod:`orchestrator.kv.wire`) rides in the transfer's notification, so the
receiver validates each layer after its bytes have landed. ``finish`` tells
every token stage that this prompt stage is done; a receiver is complete once
all of its layers arrived and the last prompt stage (the one holding the
model's last layer, which produced ``extra``) has finished. Nothing is trusted
until its header verifies: a failed or timed-out request never returns a cache.
A receiver that already holds the prompt's leading positions (``reserve``'s ``fill``:
a T-node's cache of finished requests) says so in the ticket, and each layer's write
covers only the positions after them.

Token-step deltas (replicas, hand-offs): a :class:`~orchestrator.kv.delta.DeltaStreamer`
given the same ticket writes each step into the slot's landing ring; the
receiver scatters it into the slot in ``progress()`` (``poll``, ``wait`` and
``cache`` call it; a node holding replicas calls it once per step), and
``cache(request_id)`` returns the slot with its current length. Deltas that
overtake the prompt wait until the prompt is complete.

States (:class:`KVPoll`): receiver WAITING -> TRANSFERRING -> SUCCESS | FAILED;
sender BOOTSTRAPPING -> TRANSFERRING -> SUCCESS | FAILED.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from orchestrator.kv.errors import KVTransferError, NoFreeSlot
from orchestrator.kv.primitives import kv_spans, pack, region_view, scatter, stream_out
from orchestrator.kv.transport.base import KVPoll, Region, TransferHandle, Transport
from orchestrator.kv.wire import (
    BlockHeader,
    BlockKind,
    Ticket,
    check_payload,
    check_shape,
    crc32_of,
    decode_header,
    encode_header,
    peek_request_id,
)
from orchestrator.layout import KVCache, KVLayout

log = logging.getLogger(__name__)


def _pieces(cache: KVCache, layers: range, positions: range) -> list[torch.Tensor]:
    """The contiguous runs of a KV region, in wire (and CRC) order."""
    view = region_view(cache, layers, positions)
    return [
        view[i, kv, h]
        for i in range(len(layers))
        for kv in range(2)
        for h in range(cache.layout.num_kv_heads)
    ]


def _overlaps(positions: range, parts: list[range]) -> bool:
    return any(p.start < positions.stop and positions.start < p.stop for p in parts)


# An expired ticket's slot is reused after this: a layer posted just before the deadline
# has landed by then (and the nodes' clocks agree to well within it).
_LATE_WRITE_GRACE_S = 2.0


def _sleep(waited_s: float) -> None:
    """Poll back-off: sub-millisecond at first, at most 2 ms."""
    time.sleep(min(0.002, 0.0001 + waited_s / 100))


@dataclass
class _Incoming:
    slot: int
    prompt_len: int
    missing: set[int]
    state: KVPoll = KVPoll.WAITING
    length: int = 0  # filled positions: prompt_len on success, +1 per accepted delta
    extra: bytes | None = None
    error: KVTransferError | None = None
    heard_from: dict[str, float] = field(default_factory=dict)  # peer -> last message time
    expires_at: float | None = None  # monotonic; None once used (or with no TTL)
    early_deltas: list[tuple[str, int, int | None]] = field(
        default_factory=list
    )  # (peer, pos, crc)
    abandoned: set[int] = field(default_factory=set)  # layers whose prefill stage gave up
    held: int = 0  # leading positions the slot held at reservation: no sender writes them
    # layer -> the positions of it landed so far, while it is missing (a layer may come in
    # parts: the sender's cached positions ahead of its computed ones)
    landed: dict[int, list[range]] = field(default_factory=dict)

    def writers_done(self) -> bool:
        """No sender will write into the slot again: each layer landed or was given up."""
        return self.missing <= self.abandoned


# A slot's consumed word once its request ended before its KV was whole (the client left, or
# it failed on the token side): the prefill node reads it and stops. The token stage's end of
# the request is then the P-node's cancel, with no gRPC cancellation between our nodes
# (Triton 2.51 races one against a response: server issues 7368 and 8034).
ENDED = -1


class KVReceiver:
    """Decode-side endpoint: a pool of ``num_slots`` registered KV slots."""

    def __init__(
        self,
        transport: Transport,
        layout: KVLayout,
        num_slots: int,
        secret: bytes,
        timeout_s: float = 30.0,
        checksum: bool = False,
        delta_depth: int = 8,
        reserve_ttl_s: float | None = None,
    ) -> None:
        """``reserve_ttl_s``: how long a reservation may wait for its first use, and its
        ticket's writes may go on (None: forever)."""
        if num_slots < 1 or delta_depth < 1 or not secret:
            raise ValueError("need at least one slot, a delta depth >= 1 and a non-empty secret")
        self.transport, self.layout, self.secret = transport, layout, secret
        self.timeout_s, self.checksum = timeout_s, checksum
        self.reserve_ttl_s = reserve_ttl_s
        self.pool = torch.zeros((num_slots, *layout.shape), dtype=layout.torch_dtype)
        self._base = transport.register(self.pool).addr
        # Token-step deltas land here contiguously, then are scattered into the slot.
        self.landing = torch.zeros((num_slots, delta_depth, layout.step_bytes()), dtype=torch.uint8)
        self._landing_base = transport.register(self.landing).addr
        # Positions each slot holds, read (one-sided) by delta senders for flow control.
        self.consumed = torch.zeros(num_slots, dtype=torch.int64)
        self._consumed_base = transport.register(self.consumed).addr
        self._metadata = transport.metadata()
        self._free: deque[int] = deque(range(num_slots))
        # Slots of requests that ended before their KV was whole wait out a late writer
        # before reuse, unless every prefill stage says it gave up (an ABORT): slot -> until.
        self._quarantine: dict[int, tuple[float, str, _Incoming]] = {}
        self._requests: dict[str, _Incoming] = {}
        self._ended_writers: set[str] = set()  # writers whose processes ended
        self._lock = threading.RLock()

    def _slot_addr(self, slot: int) -> int:
        return self._base + slot * self.layout.slot_bytes()

    def _take_slot(self) -> int | None:
        self._expire()
        now = time.monotonic()
        for slot, (until, _, _) in list(self._quarantine.items()):
            if until <= now:
                del self._quarantine[slot]
                self._free.append(slot)
        return self._free.popleft() if self._free else None

    def _retire(self, request_id: str, incoming: _Incoming, late_write_s: float) -> None:
        """Free a slot whose request ended; one a sender may still write into waits, its
        consumed word set to ``ENDED``: the sender reads it and stops writing."""
        if (incoming.state == KVPoll.SUCCESS or incoming.writers_done()
                or self._writers_gone(incoming)):
            self._free.append(incoming.slot)
        else:
            self.consumed[incoming.slot] = ENDED
            until = time.monotonic() + late_write_s
            self._quarantine[incoming.slot] = (until, request_id, incoming)

    def reserve(self, request_id: str, prompt_len: int,
                fill: Callable[[KVCache], int] | None = None) -> bytes:
        """Take a slot for ``request_id``; returns the ticket the prefill node writes with.

        ``fill(slot)`` may copy the prompt's leading positions into the (empty) slot from
        what this node already holds (decode-side reuse) and returns how many it filled,
        fewer than ``prompt_len``: the ticket tells the senders to write only the rest."""
        if not 0 < prompt_len <= self.layout.max_seq_len:
            raise ValueError(f"prompt_len {prompt_len} not in [1, {self.layout.max_seq_len}]")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already holds a slot")
            slot = self._take_slot()
            if slot is None:
                raise NoFreeSlot(f"no free KV slot ({len(self.pool)} in use)")
            incoming = _Incoming(slot, prompt_len, set(self.layout.layer_range))
            expires = 0.0
            if self.reserve_ttl_s is not None:
                incoming.expires_at = time.monotonic() + self.reserve_ttl_s
                expires = time.time() + self.reserve_ttl_s
            self._requests[request_id] = incoming
            self.consumed[slot] = 0
        if fill is not None:  # the slot is ours, and no sender has its ticket yet
            incoming.held = self._fill(slot, prompt_len, fill)
        depth, step = self.landing.shape[1], self.layout.step_bytes()
        ticket = Ticket(
            request_id,
            self.transport.name,
            self._metadata,
            self._slot_addr(slot),
            self.layout,
            prompt_len,
            self.checksum,
            landing_addr=self._landing_base + slot * depth * step,
            landing_depth=depth,
            consumed_addr=self._consumed_base + slot * self.consumed.element_size(),
            expires=expires,
            held=incoming.held,
        )
        return ticket.encode(self.secret)

    def _fill(self, slot: int, prompt_len: int, fill: Callable[[KVCache], int]) -> int:
        """The positions ``fill`` put into the slot (0 if it failed: the senders write all)."""
        try:
            held = fill(KVCache(self.layout, self.pool[slot], 0))
            if not 0 <= held < prompt_len:
                raise ValueError(f"filled {held} positions of a {prompt_len}-token prompt: "
                                 "a sender must write one at least")
        except Exception:  # noqa: BLE001  (reuse is soft state: never worth the request)
            log.exception("could not fill the KV slot from this node's cache")
            return 0
        return held

    def reused(self, request_id: str) -> int:
        """The leading positions the request's slot held at reservation (not sent); 0 for a
        request that holds no slot here."""
        with self._lock:
            incoming = self._requests.get(request_id)
            return 0 if incoming is None else incoming.held

    def _expire(self) -> None:
        """Drop reservations never used before their tickets expired."""
        self._progress()  # a filled one is freed at once
        now = time.monotonic()
        for request_id, incoming in list(self._requests.items()):
            if incoming.expires_at is not None and incoming.expires_at < now:
                log.warning("KV slot reservation of %r expired unused", request_id)
                self._retire(request_id, self._requests.pop(request_id), _LATE_WRITE_GRACE_S)

    def progress(self) -> None:
        """Handle what arrived: validate blocks, scatter token-step deltas into slots.

        ``poll``, ``wait`` and ``cache`` call it; a node that holds replicas
        calls it once per step so delta senders never wait on a full landing ring.
        """
        with self._lock:
            self._progress()

    def poll(self, request_id: str) -> KVPoll:
        with self._lock:
            self._progress()
            return self._get(request_id).state

    def wait(self, request_id: str, timeout_s: float | None = None) -> tuple[KVCache, bytes]:
        """Block until the request's KV is complete; the cache is a view of its slot."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        while True:
            with self._lock:
                self._progress()
                incoming = self._get(request_id)
                if incoming.state == KVPoll.SUCCESS:
                    assert incoming.extra is not None
                    return self._cache(incoming), incoming.extra
                if incoming.state == KVPoll.FAILED:
                    assert incoming.error is not None
                    raise incoming.error
                waited = time.monotonic() - start
                if waited > timeout_s:
                    self._fail(request_id, self._timeout_error(request_id, incoming, waited))
                    continue
            _sleep(waited)

    def cache(self, request_id: str) -> KVCache:
        """The slot as it stands now, including token-step deltas streamed into it."""
        with self._lock:
            self._progress()
            incoming = self._get(request_id)
            if incoming.state != KVPoll.SUCCESS:
                raise RuntimeError(f"request {request_id!r} is {incoming.state.name}, not ready")
            return self._cache(incoming)

    def _cache(self, incoming: _Incoming) -> KVCache:
        return KVCache(self.layout, self.pool[incoming.slot], incoming.length)

    def release(self, request_id: str) -> None:
        """Free the request's slot (after use, an error or a cancel)."""
        with self._lock:
            incoming = self._requests.pop(request_id, None)
            if incoming is not None:
                self._retire(request_id, incoming, self.timeout_s)

    def held(self) -> int:
        """Slots held by requests (a failed one's slot, waiting out a late writer, is not:
        it comes back on its own)."""
        with self._lock:
            self._expire()
            return len(self._requests)

    def close(self) -> None:
        """Unregister the pool; outstanding requests are dropped."""
        for tensor in (self.pool, self.landing, self.consumed):
            self.transport.deregister(tensor)
        self._requests.clear()

    def _get(self, request_id: str) -> _Incoming:
        """The request's reservation, now in use: it no longer expires."""
        try:
            incoming = self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no slot on this node") from None
        incoming.expires_at = None
        return incoming

    def _timeout_error(self, rid: str, incoming: _Incoming, waited: float) -> KVTransferError:
        missing = sorted(incoming.missing)
        want = f"layers {missing}" if missing else "the last prompt stage's finish"
        if not incoming.heard_from:
            return KVTransferError(
                "<no sender>",
                f"timed out after {waited:.1f}s: nothing received, waiting for {want}",
                rid,
            )
        peer, last = max(incoming.heard_from.items(), key=lambda kv: kv[1])
        silent = time.monotonic() - last
        return KVTransferError(
            peer,
            f"timed out after {waited:.1f}s waiting for {want}; peer silent for {silent:.1f}s",
            rid,
        )

    def _fail(self, request_id: str, error: KVTransferError, force: bool = False) -> None:
        """Mark a pending request failed (``force``: also one that already succeeded)."""
        incoming = self._requests.get(request_id)
        done = (KVPoll.FAILED,) if force else (KVPoll.SUCCESS, KVPoll.FAILED)
        if incoming is not None and incoming.state not in done:
            incoming.state, incoming.error = KVPoll.FAILED, error
            log.warning("%s", error)

    def _progress(self) -> None:
        for peer, message in self.transport.drain_notifications():
            try:
                header = decode_header(message, self.secret, peer)
            except KVTransferError as error:
                # Unauthenticated: only ever fails the request it names, never fills it.
                self._fail(peek_request_id(message) or "", error)
                continue
            if header.kind == BlockKind.DELTA:
                self._accept_delta(peer, header)
                continue
            if header.kind == BlockKind.ABORT:
                self._accept_abort(header)
                continue
            if header.kind == BlockKind.CLAIM:
                self._accept_claim(peer, header)
                continue
            incoming = self._requests.get(header.request_id)
            if incoming is None or incoming.state in (KVPoll.SUCCESS, KVPoll.FAILED):
                log.debug(
                    "dropping a block of inactive request %r from %s", header.request_id, peer
                )
                continue
            incoming.heard_from[peer] = time.monotonic()
            try:
                self._accept(peer, header, incoming)
            except KVTransferError as error:
                self._fail(header.request_id, error)

    def _accept(self, peer: str, header: BlockHeader, incoming: _Incoming) -> None:
        rid = header.request_id
        if header.kind == BlockKind.FINISH:
            if header.first_layer + header.num_layers == header.total_layers:
                incoming.extra = header.extra
        elif header.kind == BlockKind.LAYERS:
            check_shape(header, self.layout, peer)
            if header.seq_len != incoming.prompt_len:
                raise KVTransferError(
                    peer,
                    f"sequence length mismatch: block has "
                    f"{header.seq_len}, reserved {incoming.prompt_len}",
                    rid,
                )
            layers, positions = header.layer_range, header.positions
            if not incoming.held <= positions.start < positions.stop <= incoming.prompt_len:
                raise KVTransferError(
                    peer, f"positions [{positions.start}, {positions.stop}) outside the "
                    f"[{incoming.held}, {incoming.prompt_len}) this slot lacks", rid)
            if not incoming.missing.issuperset(layers) or any(
                    _overlaps(positions, incoming.landed.get(layer, [])) for layer in layers):
                raise KVTransferError(peer, f"layers {list(layers)} positions [{positions.start}"
                                      f", {positions.stop}) received twice", rid)
            expected = len(layers) * len(positions) * self.layout.token_bytes_per_layer()
            check_payload(header, expected, peer)
            self._check_crc(peer, header, incoming, layers)
            for layer in layers:
                parts = incoming.landed.setdefault(layer, [])
                parts.append(positions)
                if sum(map(len, parts)) == incoming.prompt_len - incoming.held:
                    incoming.missing.discard(layer)
                    del incoming.landed[layer]
            incoming.state = KVPoll.TRANSFERRING
        else:
            raise KVTransferError(peer, f"unexpected {header.kind.name} block", rid)
        if not incoming.missing and incoming.extra is not None:
            incoming.state, incoming.length = KVPoll.SUCCESS, incoming.prompt_len
            self.consumed[incoming.slot] = incoming.length
            early, incoming.early_deltas = incoming.early_deltas, []
            for early_peer, position, crc in early:
                self._scatter_delta(early_peer, rid, incoming, position, crc)

    def _accept_abort(self, header: BlockHeader) -> None:
        """A prefill stage gave up on a request: a slot all its writers are done with is
        free at once. (A pending request still fails by its own timeout or cancel.)"""
        rid = header.request_id
        incoming = self._requests.get(rid)
        if incoming is not None:
            incoming.abandoned.update(header.layer_range)
            return
        for slot, (_, quarantined, incoming) in list(self._quarantine.items()):
            if quarantined == rid:
                incoming.abandoned.update(header.layer_range)
                if incoming.writers_done():
                    del self._quarantine[slot]
                    self._free.append(slot)

    def _accept_claim(self, peer: str, header: BlockHeader) -> None:
        """``peer`` will write the request's prompt KV (a late claim of an ended request
        still names the writer its slot waits out)."""
        rid = header.request_id
        incoming = self._requests.get(rid) or next(
            (held for _, quarantined, held in self._quarantine.values() if quarantined == rid),
            None)
        if incoming is not None:
            incoming.heard_from.setdefault(peer, time.monotonic())
            self._free_ended_writers()

    def writers_ended(self, peers: list[str]) -> None:
        """These writers' processes ended (the fault controller says so): a slot waiting
        out a late write from them alone is free now."""
        with self._lock:
            self._ended_writers.update(peers)
            self._free_ended_writers()

    def _free_ended_writers(self) -> None:
        for slot, (_, rid, incoming) in list(self._quarantine.items()):
            if self._writers_gone(incoming):
                log.info("KV slot of %r free: its writers %s ended", rid,
                         sorted(incoming.heard_from))
                del self._quarantine[slot]
                self._free.append(slot)

    def _writers_gone(self, incoming: _Incoming) -> bool:
        """Every writer of the slot is known and has ended (none known: one may come)."""
        return bool(incoming.heard_from) and incoming.heard_from.keys() <= self._ended_writers

    def _accept_delta(self, peer: str, header: BlockHeader) -> None:
        """One token step of a batch: entries ``[request id, position, crc32 | None]``."""
        entries = [(str(rid), int(pos), crc) for rid, pos, crc in json.loads(header.extra)]
        try:
            check_shape(header, self.layout, peer)
            if header.num_layers != self.layout.num_layers:
                raise KVTransferError(
                    peer,
                    f"delta covers {header.num_layers} layers, "
                    f"receiver holds {self.layout.num_layers}",
                )
            check_payload(header, len(entries) * self.layout.step_bytes(), peer)
        except KVTransferError as error:
            for rid, _, _ in entries:
                self._fail(rid, error, force=True)
            return
        for rid, position, crc in entries:
            incoming = self._requests.get(rid)
            if incoming is None or incoming.state == KVPoll.FAILED:
                continue  # released or failed: nothing to fill
            if incoming.state != KVPoll.SUCCESS:
                # The prompt is still arriving (maybe from another node); the sender's
                # flow control keeps the landing block intact until it completes.
                incoming.early_deltas.append((peer, position, crc))
                continue
            try:
                self._scatter_delta(peer, rid, incoming, position, crc)
            except KVTransferError as error:
                self._fail(rid, error, force=True)

    def _scatter_delta(
        self, peer: str, rid: str, incoming: _Incoming, position: int, crc: int | None
    ) -> None:
        if position != incoming.length:
            raise KVTransferError(
                peer,
                f"delta for position {position}, but the slot holds {incoming.length} positions",
                rid,
            )
        block = self.landing[incoming.slot, position % self.landing.shape[1]]
        if crc is None and self.checksum:
            raise KVTransferError(peer, "delta carries no checksum; receiver requires one", rid)
        if crc is not None and crc32_of([block]) != crc:
            raise KVTransferError(
                peer,
                f"bad delta checksum at position {position}: {crc32_of([block]):08x} vs {crc:08x}",
                rid,
            )
        step_shape = (self.layout.num_layers, 2, self.layout.num_kv_heads, self.layout.head_dim)
        slot = self.pool[incoming.slot]
        slot[:, :, :, position].copy_(block.view(self.layout.torch_dtype).view(step_shape))
        incoming.length = position + 1
        incoming.heard_from[peer] = time.monotonic()
        self.consumed[incoming.slot] = incoming.length

    def _check_crc(self, peer: str, header: BlockHeader, incoming: _Incoming, layers) -> None:
        if header.crc32 is None:
            if self.checksum:
                raise KVTransferError(
                    peer, "block carries no checksum; receiver requires one", header.request_id
                )
            return
        cache = KVCache(self.layout, self.pool[incoming.slot], incoming.prompt_len)
        got = crc32_of(_pieces(cache, layers, header.positions))
        if got != header.crc32:
            raise KVTransferError(
                peer,
                f"bad checksum for layers {list(layers)}: payload CRC32 "
                f"{got:08x}, header says {header.crc32:08x}",
                header.request_id,
            )


@dataclass
class SendHandle:
    """One request's send state on a prefill node."""

    request_id: str
    tickets: list[Ticket]
    owner: dict[int, int]  # global layer -> index of the ticket whose stage holds it
    prompt_len: int
    total_layers: int
    staging: int  # index of this request's staging block
    transfers: list[TransferHandle] = field(default_factory=list)
    state: KVPoll = KVPoll.BOOTSTRAPPING
    finished: bool = False
    error: KVTransferError | None = None
    released: bool = False  # its staging block is given back (or drains to be)
    sent_bytes: int = 0  # KV posted (a ticket's held positions are not)
    ahead: int = 0  # leading positions of every layer posted before any layer (save_ahead)
    ahead_bytes: int = 0  # of sent_bytes, those posted by save_ahead


class KVSender:
    """Prefill-side endpoint; ``max_inflight`` requests may be sending at once."""

    def __init__(
        self,
        transport: Transport,
        layout: KVLayout,
        secret: bytes,
        checksum: bool = False,
        max_inflight: int = 4,
    ) -> None:
        if not secret:
            raise ValueError("need a non-empty secret")
        self.transport, self.layout, self.secret = transport, layout, secret
        self.checksum = checksum
        self.staging = torch.empty((max_inflight, layout.slot_bytes()), dtype=torch.uint8)
        self._staging_base = transport.register(self.staging).addr
        self._word = torch.zeros(1, dtype=torch.int64)  # landing of a slot's consumed word
        self._word_region = transport.register(self._word)
        self._free_staging = deque(range(max_inflight))
        self._draining: list[SendHandle] = []  # timed-out handles whose staging is still read
        self._lock = threading.RLock()

    def start(self, request_id: str, tickets: list[bytes]) -> SendHandle:
        """Verify the tickets, connect to their nodes and take a staging block."""
        if not tickets:
            raise ValueError("need one ticket per token stage")
        decoded = [Ticket.decode(t, self.secret) for t in tickets]
        for ticket in decoded:
            self._check_ticket(request_id, ticket, decoded[0].prompt_len)
        stage_ranges = [t.layout.layer_range for t in decoded]
        mine = self.layout.layer_range
        owner = {layer: r.dst for r in stream_out(mine, stage_ranges) for layer in r.layers}
        nodes = ",".join(t.node for t in decoded)
        if sum(map(len, stage_ranges)) != len(set().union(*stage_ranges)):
            raise KVTransferError(
                nodes, f"token stages {[list(r) for r in stage_ranges]} overlap", request_id
            )
        if len(owner) != len(mine):
            raise KVTransferError(
                nodes,
                f"token stages {[list(r) for r in stage_ranges]} do not hold layers "
                f"{sorted(set(mine) - set(owner))} of this prompt stage",
                request_id,
            )
        for ticket in decoded:
            try:
                self.transport.add_peer(ticket.node, ticket.metadata)
            except Exception as exc:
                raise KVTransferError(ticket.node, f"cannot connect: {exc}", request_id) from exc
        with self._lock:
            self._reclaim_staging()
            if not self._free_staging:
                raise KVTransferError(
                    "<local>",
                    f"all {len(self.staging)} staging blocks are in flight (raise max_inflight)",
                    request_id,
                )
            staging = self._free_staging.popleft()
        total = max(r.stop for r in stage_ranges)
        return SendHandle(request_id, decoded, owner, decoded[0].prompt_len, total, staging)

    def _check_ticket(self, request_id: str, ticket: Ticket, prompt_len: int) -> None:
        theirs, ours = ticket.layout, self.layout
        for name, got, want in (
            ("request id", ticket.request_id, request_id),
            ("KV heads", theirs.num_kv_heads, ours.num_kv_heads),
            ("head size", theirs.head_dim, ours.head_dim),
            ("dtype", theirs.dtype, ours.dtype),
            ("prompt length", ticket.prompt_len, prompt_len),
        ):
            if got != want:
                raise KVTransferError(
                    ticket.node, f"{name} mismatch: ticket has {got}, sender {want}", request_id
                )
        if not 0 <= ticket.held < ticket.prompt_len:
            raise KVTransferError(ticket.node, f"ticket holds {ticket.held} positions of a "
                                  f"{ticket.prompt_len}-token prompt", request_id)
        if ticket.expired:
            raise KVTransferError(ticket.node, "ticket expired: its KV slot reservation was "
                                  "not used in time", request_id)
        if ticket.prompt_len > ours.max_seq_len:
            raise KVTransferError(
                ticket.node,
                f"prompt length {ticket.prompt_len} exceeds the "
                f"sender's max_seq_len {ours.max_seq_len}",
                request_id,
            )

    def save_ahead(self, handle: SendHandle, cache: KVCache, positions: int) -> None:
        """Post the leading ``positions`` of every layer at once (a prompt's KV the node had
        cached, before its rest is computed): one write per token stage, of the positions
        its ticket does not hold. ``save_layer`` then posts only each layer's later
        positions. Call it before any ``save_layer``; never blocks, errors surface at wait."""
        if handle.transfers or handle.ahead:
            raise ValueError("save_ahead goes before any layer of the request is posted")
        if not 0 <= positions < handle.prompt_len:
            raise ValueError(f"{positions} positions ahead of a {handle.prompt_len}-token "
                             "prompt: one at least is left to its layers")
        handle.ahead = positions
        for index, ticket in enumerate(handle.tickets):
            layers = [layer for layer, owner in handle.owner.items() if owner == index]
            if layers and ticket.held < positions:
                before = handle.sent_bytes
                self._post(handle, index, range(min(layers), max(layers) + 1),
                           range(ticket.held, positions), cache)
                handle.ahead_bytes += handle.sent_bytes - before

    def save_layer(self, handle: SendHandle, global_layer: int, cache: KVCache) -> None:
        """Post layer ``global_layer``'s prompt KV (the positions after those its token
        stage holds and those ``save_ahead`` posted); never blocks, errors surface at wait."""
        ticket_index = handle.owner.get(global_layer)
        if ticket_index is None:
            raise ValueError(f"layer {global_layer} is not on this prompt stage")
        start = max(handle.tickets[ticket_index].held, handle.ahead)
        self._post(handle, ticket_index, range(global_layer, global_layer + 1),
                   range(start, handle.prompt_len), cache)

    def _post(self, handle: SendHandle, ticket_index: int, layers: range, positions: range,
              cache: KVCache) -> None:
        """Pack ``positions`` of ``layers`` into their places in the staging block and write
        them into the ticket's slot as one transfer, its checked header in the notification."""
        if handle.error is not None or handle.finished:
            return
        ticket = handle.tickets[ticket_index]
        if ticket.expired:  # its slot may be someone else's by now: write nothing
            handle.error = KVTransferError(ticket.node, f"ticket expired before layers "
                                           f"{list(layers)} were sent", handle.request_id)
            handle.state = KVPoll.FAILED
            return
        row = self.layout.token_bytes_per_layer()
        nbytes = len(positions) * row  # of each layer
        local, packed = [], []
        for layer in layers:
            # a layer's positions [held, prompt_len) have their place in its staging area
            offset = ((layer - self.layout.first_layer) * handle.prompt_len
                      + positions.start - ticket.held) * row
            packed.append(self.staging[handle.staging, offset : offset + nbytes])
            pack(cache, range(layer, layer + 1), positions, packed[-1])
            local.append(self._staging_region(handle, offset, nbytes))
        crc = crc32_of(packed) if self.checksum or ticket.checksum else None
        header = BlockHeader.for_layout(
            BlockKind.LAYERS,
            handle.request_id,
            self.layout.layers(layers.start, len(layers)),
            seq_len=handle.prompt_len,
            payload_bytes=nbytes * len(layers),
            crc32=crc,
            first_position=positions.start,
            end_position=positions.stop,
        )
        remote = kv_spans(ticket.layout, ticket.slot_addr, layers, positions)
        transfer = scatter(
            self.transport, ticket.node, local, remote, encode_header(header, self.secret)
        )
        handle.transfers.append(transfer)
        handle.sent_bytes += nbytes * len(layers)
        handle.state = KVPoll.TRANSFERRING
        self.poll(handle)

    def _staging_region(self, handle: SendHandle, offset: int, nbytes: int) -> Region:
        return Region(self._staging_base + handle.staging * self.staging.shape[1] + offset, nbytes)

    def finish(self, handle: SendHandle, extra: bytes = b"") -> None:
        """Tell every token stage this prompt stage is done; ``extra`` rides along."""
        if handle.error is not None:
            return
        header = BlockHeader.for_layout(
            BlockKind.FINISH,
            handle.request_id,
            self.layout,
            seq_len=handle.prompt_len,
            payload_bytes=0,
            total_layers=handle.total_layers,
            extra=extra,
        )
        message = encode_header(header, self.secret)
        for ticket in handle.tickets:
            try:
                self.transport.notify(ticket.node, message)
            except ConnectionError as exc:
                handle.error = KVTransferError(ticket.node, str(exc), handle.request_id)
                handle.state = KVPoll.FAILED
                return
        handle.finished = True

    def poll(self, handle: SendHandle) -> KVPoll:
        """Progress the posted layers; SUCCESS once all landed and ``finish`` was sent.

        NIXL sends a transfer's notification (the block header) when the
        initiator observes completion, so every ``save_layer`` and ``poll``
        also moves the earlier layers' notifications along.
        """
        if handle.state in (KVPoll.BOOTSTRAPPING, KVPoll.TRANSFERRING):
            landed = [self._check(handle, t) for t in handle.transfers]
            if handle.state != KVPoll.FAILED and handle.finished and all(landed):
                handle.state = KVPoll.SUCCESS
        return handle.state

    def _check(self, handle: SendHandle, transfer: TransferHandle) -> bool:
        """True once ``transfer`` is done; records a failure on the handle."""
        state = self.transport.poll(transfer)
        if state == KVPoll.FAILED and handle.error is None:
            handle.error = KVTransferError(
                transfer.peer, transfer.error or "failed", handle.request_id
            )
            handle.state = KVPoll.FAILED
        return state == KVPoll.SUCCESS

    def wait_for_save(self, handle: SendHandle, timeout_s: float) -> None:
        """Block until every posted layer landed and ``finish`` was sent."""
        start = time.monotonic()
        try:
            while True:
                state = self.poll(handle)
                if state == KVPoll.FAILED:
                    assert handle.error is not None
                    raise handle.error
                if state == KVPoll.SUCCESS:
                    return
                waited = time.monotonic() - start
                if waited > timeout_s:
                    pending = [t.peer for t in handle.transfers if t.state != KVPoll.SUCCESS]
                    why = "finish() was not called" if not handle.finished else "transfers pending"
                    handle.error = KVTransferError(
                        ",".join(sorted(set(pending))) or "<local>",
                        f"timed out after {waited:.1f}s: {why} ({len(pending)} of "
                        f"{len(handle.transfers)} unfinished)",
                        handle.request_id,
                    )
                    handle.state = KVPoll.FAILED
                    raise handle.error
                _sleep(waited)
        finally:
            self.release(handle)

    def release(self, handle: SendHandle) -> None:
        """Give the handle's staging block back once no transfer reads it; call it on every
        exit (``wait_for_save`` does). A handle given up before it succeeded fails."""
        with self._lock:
            if handle.released:
                return
            handle.released = True
            if handle.state != KVPoll.SUCCESS and handle.error is None:
                handle.error = KVTransferError("<local>", "abandoned", handle.request_id)
                handle.state = KVPoll.FAILED
            self._draining.append(handle)
            self._reclaim_staging()

    def claim(self, request_id: str, tickets: list[bytes]) -> None:
        """Tell the token stages this node will write the request's prompt KV (before it
        waits its turn): if this process ends, they free its slots when told, not after
        their late-write wait. A stage that cannot be reached is left to the transfer."""
        header = encode_header(BlockHeader.for_layout(
            BlockKind.CLAIM, request_id, self.layout, seq_len=1, payload_bytes=0), self.secret)
        for raw in tickets:
            # a bad ticket fails the request in ``start``, with the reason
            with contextlib.suppress(ConnectionError, KVTransferError, ValueError):
                ticket = Ticket.decode(raw, self.secret)
                self.transport.add_peer(ticket.node, ticket.metadata)
                self.transport.notify(ticket.node, header)

    def give_up(self, request_id: str, tickets: list[bytes]) -> None:
        """Tell the token stages a prompt will never be sent (its client left before it
        started): their slots need not wait for a late write."""
        self.release(self.start(request_id, tickets))

    def ended(self, ticket: bytes, timeout_s: float = 1.0) -> bool:
        """Whether the token stage of ``ticket`` (the first stage's: its head ends the request
        on every stage) ended the request: its slot's consumed word, read one-sided. False
        if it cannot be read (a lost node fails the transfer itself)."""
        decoded = Ticket.decode(ticket, self.secret)
        remote = Region(decoded.consumed_addr, self._word.element_size())
        with self._lock:
            try:
                transfer = self.transport.read(decoded.node, [(self._word_region, remote)])
                deadline = time.monotonic() + timeout_s
                while (state := self.transport.poll(transfer)) == KVPoll.TRANSFERRING:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.0001)
            except Exception:  # noqa: BLE001  (the peer is gone or unknown: not ended here)
                log.debug("could not read the slot of %s", decoded.request_id, exc_info=True)
                return False
            return state == KVPoll.SUCCESS and int(self._word[0]) == ENDED

    def in_flight(self) -> int:
        """Staging blocks taken (0 once every request ended and its transfers drained)."""
        with self._lock:
            self._reclaim_staging()
            return len(self.staging) - len(self._free_staging)

    def close(self) -> None:
        """Unregister the staging blocks (after every handle's ``wait_for_save``)."""
        self.transport.deregister(self.staging)
        self.transport.deregister(self._word)

    def _reclaim_staging(self) -> None:
        """Free staging blocks whose transfers are no longer in flight; a handle given up
        tells its token stages it writes nothing more (their slots need not wait it out)."""
        still = []
        for handle in self._draining:
            if any(self.transport.poll(t) == KVPoll.TRANSFERRING for t in handle.transfers):
                still.append(handle)
                continue
            self._free_staging.append(handle.staging)
            if handle.state != KVPoll.SUCCESS:
                self._abort(handle)
        self._draining = still

    def _abort(self, handle: SendHandle) -> None:
        header = BlockHeader.for_layout(BlockKind.ABORT, handle.request_id, self.layout,
                                        seq_len=handle.prompt_len, payload_bytes=0)
        message = encode_header(header, self.secret)
        for ticket in handle.tickets:
            with contextlib.suppress(ConnectionError):  # gone: its slot went with it
                self.transport.notify(ticket.node, message)
