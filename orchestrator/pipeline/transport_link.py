"""A stage-to-stage link over the KV library's transport (NIXL across nodes).

The receiving stage registers a ring of ``slots`` buffers and hands its sender
a :class:`LinkTicket`. Each message is one one-sided WRITE into the next ring
slot: a JSON header (ids, shapes, dtypes) followed by the tensors' bytes. The
notification riding on the write names the slot, and arrives after the data,
so the receiver never sees a half-written message. The ring cannot be
overrun: at most ``num_microbatches`` steps and one :class:`KVProbe` exist in
a pipeline at once, and a ring of ``num_microbatches + 2`` slots is consumed
in order.

Notifications that are not slot numbers are *control notes* (a stage's
heartbeat, a stage reporting that its own outgoing link failed): the receiver
keeps them in ``control`` for its owner.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.sampling import SamplingParams
from orchestrator.kv.transport.base import KVPoll, Region, Transport
from orchestrator.layout import DTYPE_BYTES, torch_dtype
from orchestrator.pipeline.link import (
    KVProbe,
    LinkError,
    LinkTimeout,
    Message,
    Shutdown,
    StepMessage,
    TokenMessage,
)

_LENGTH = struct.Struct("!I")  # header bytes, at the front of a slot
_ALIGN = 16
_DTYPES = {name: torch_dtype(name) for name in [*DTYPE_BYTES, "int64"]}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
SPIN_S = 0.0002  # poll without sleeping this long first: a sleep costs more than a hop
# A ring that got nothing for IDLE_AFTER_S is idle, not between two steps: it is polled every
# IDLE_POLL_S, without the spin, not every poll_s. Spinning and 2,000 polls a second in each
# T-stage kept an idle 16-node emulated host ~0.8 of its 2 cores busy. ``wake`` still ends a
# wait at once; a message after a pause of at least IDLE_AFTER_S is seen at most IDLE_POLL_S
# later (under 0.5% of that pause).
IDLE_AFTER_S = 0.5
IDLE_POLL_S = 0.002
_PROBE_FIELDS = ("requests", "release", "ready", "failed", "waiting_at")  # dicts keyed by seq id


@dataclass(frozen=True)
class LinkTicket:
    """Where a sender writes: the receiving node and its registered ring."""

    node: str
    metadata: bytes
    addr: int
    slots: int
    slot_bytes: int

    def to_dict(self) -> dict:
        return asdict(self) | {"metadata": base64.b64encode(self.metadata).decode()}

    @classmethod
    def from_dict(cls, d: dict) -> LinkTicket:
        return cls(**(d | {"metadata": base64.b64decode(d["metadata"])}))


class TransportReceiver:
    """The receiving half: ``recv`` only. Owns its transport's notifications."""

    def __init__(self, transport: Transport, slots: int, slot_bytes: int,
                 poll_s: float = 0.0005) -> None:
        if slots < 2 or slot_bytes < 64:
            raise ValueError(f"a link ring needs >= 2 slots of >= 64 B, got {slots} x {slot_bytes}")
        self.transport, self.slots, self.slot_bytes, self.poll_s = (
            transport, slots, slot_bytes, poll_s)
        self.ring = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        self.region = transport.register(self.ring)
        self._arrived: deque[int] = deque()
        self.control: deque[tuple[str, bytes]] = deque()  # (peer, note), oldest first
        self._woken = False
        self._wakeup = threading.Event()  # ends an idle ring's wait
        self._last_arrival = time.monotonic()  # when a message last arrived (not a note:
        # the stages' heartbeats reach the head's ring 4 times a second)
        self.received = 0  # messages ``recv`` returned
        self._draining = threading.Lock()  # ``waiting`` drains from another thread

    def ticket(self) -> LinkTicket:
        return LinkTicket(self.transport.name, self.transport.metadata(), self.region.addr,
                          self.slots, self.slot_bytes)

    def recv(self, timeout_s: float) -> Message | None:
        begin = time.monotonic()
        deadline = begin + timeout_s
        while not self._arrived:
            self.drain()
            if self._arrived:
                break
            now = time.monotonic()
            if now >= deadline or self._woken:
                self._woken = False
                self._wakeup.clear()
                return None
            if now - self._last_arrival > IDLE_AFTER_S:
                self._wakeup.wait(min(max(self.poll_s, IDLE_POLL_S), deadline - now))
            elif now - begin >= SPIN_S:  # a message due soon is caught without a sleep
                time.sleep(self.poll_s)
        slot = self._arrived.popleft()
        self.received += 1
        return decode(self.ring[slot * self.slot_bytes : (slot + 1) * self.slot_bytes])

    def wake(self) -> None:
        self._woken = True  # seen within one poll_s sleep
        self._wakeup.set()  # or at once by an idle ring

    def waiting(self) -> bool:
        """Drains the transport first: a message that reached this node counts even while
        its receiving thread is not scheduled (recovery asks from another thread)."""
        self.drain()
        return bool(self._arrived)

    def drain(self) -> None:
        """Sort what arrived into ring slots and control notes."""
        with self._draining:
            for peer, note in self.transport.drain_notifications():
                if note.isdigit():
                    self._arrived.append(int(note))
                    self._last_arrival = time.monotonic()
                else:
                    self.control.append((peer, note))


class TransportSender:
    """The sending half: ``send`` only."""

    def __init__(self, transport: Transport, ticket: LinkTicket, poll_s: float = 0.0002) -> None:
        self.transport, self.ticket, self.poll_s = transport, ticket, poll_s
        transport.add_peer(ticket.node, ticket.metadata)
        self.staging = torch.zeros(ticket.slot_bytes, dtype=torch.uint8)
        self.local = transport.register(self.staging)
        self._next_slot = 0

    def send(self, message: Message, timeout_s: float) -> None:
        nbytes = encode(message, self.staging)
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % self.ticket.slots
        remote = Region(self.ticket.addr + slot * self.ticket.slot_bytes, nbytes)
        handle = self.transport.write(self.ticket.node, [(self.local.sub(0, nbytes), remote)],
                                      str(slot).encode())
        begin = time.monotonic()
        deadline = begin + timeout_s
        while (state := self.transport.poll(handle)) is not KVPoll.SUCCESS:
            if state is KVPoll.FAILED:
                raise LinkError(f"link to {self.ticket.node}: {handle.error}")
            now = time.monotonic()
            if now >= deadline:
                raise LinkTimeout(f"link to {self.ticket.node}: write not done in {timeout_s} s")
            if now - begin >= SPIN_S:
                time.sleep(self.poll_s)  # the staging buffer is reused: wait until it has left


# -- the wire format ---------------------------------------------------------------------


def encode(message: Message, out: torch.Tensor) -> int:
    """Write ``message`` into the flat uint8 buffer ``out``; returns the bytes used."""
    tensors: list[torch.Tensor] = []
    if isinstance(message, Shutdown):
        header: dict = {"type": "shutdown"}
    elif isinstance(message, TokenMessage):
        header = {"type": "tokens", "microbatch": message.microbatch, "step": message.step,
                  "tokens": [[s, t] for s, t in message.tokens.items()], "error": message.error,
                  "log_probs": [[s, p.to_list()] for s, p in message.log_probs.items()],
                  "probe": _probe_fields(message.probe)}
    elif isinstance(message, KVProbe):
        header = {"type": "probe", **_probe_fields(message)}
    else:
        tensors = ([] if message.inputs is None else [message.inputs]) + list(message.prompts)
        header = {
            "type": "step", "microbatch": message.microbatch, "step": message.step,
            "seq_ids": message.seq_ids, "has_inputs": message.inputs is not None,
            "prompt_seq_ids": message.prompt_seq_ids, "partial": message.partial,
            "admit": message.admit, "resume": list(message.resume.items()),
            "release": message.release, "error": message.error,
            "cached_blocks": list(message.cached_blocks.items()),
            "store_blocks": list(message.store_blocks.items()),
            "sampling": [[s, asdict(p)] for s, p in message.sampling.items()],
            "probe": _probe_fields(message.probe),
        }
    specs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append({"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset,
                      "nbytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    header["tensors"] = specs
    raw = json.dumps(header).encode()
    start = -(-(_LENGTH.size + len(raw)) // _ALIGN) * _ALIGN
    total = start + offset
    if total > len(out):
        raise ValueError(f"message of {total} B does not fit a link slot of {len(out)} B")
    prefix = _LENGTH.pack(len(raw)) + raw
    out[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    for t, spec in zip(tensors, specs, strict=True):
        at = start + spec["offset"]
        out[at : at + spec["nbytes"]] = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return total


def decode(slot: torch.Tensor) -> Message:
    """Inverse of :func:`encode`; tensors are copied out, so the slot can be reused."""
    (length,) = _LENGTH.unpack(slot[: _LENGTH.size].numpy().tobytes())
    header = json.loads(slot[_LENGTH.size : _LENGTH.size + length].numpy().tobytes())
    if header["type"] == "shutdown":
        return Shutdown()
    if header["type"] == "tokens":
        return TokenMessage(header["microbatch"], header["step"],
                            {s: t for s, t in header["tokens"]}, header["error"],
                            {s: TokenLogProb.from_list(p) for s, p in header["log_probs"]},
                            _probe_of(header["probe"]))
    if header["type"] == "probe":
        return _probe_of(header)
    start = -(-(_LENGTH.size + length) // _ALIGN) * _ALIGN
    tensors = [
        slot[start + s["offset"] : start + s["offset"] + s["nbytes"]].clone()
        .view(_DTYPES[s["dtype"]]).reshape(s["shape"])
        for s in header["tensors"]
    ]
    inputs = tensors.pop(0) if header["has_inputs"] else None
    return StepMessage(
        microbatch=header["microbatch"], step=header["step"], seq_ids=header["seq_ids"],
        inputs=inputs, prompt_seq_ids=header["prompt_seq_ids"], prompts=tensors,
        partial=header["partial"],
        admit=header["admit"], resume=dict(header["resume"]), release=header["release"],
        error=header["error"],
        cached_blocks=dict(header["cached_blocks"]),
        store_blocks={s: [(b, i) for b, i in blocks] for s, blocks in header["store_blocks"]},
        sampling={s: SamplingParams(**p) for s, p in header["sampling"]},
        probe=_probe_of(header["probe"]),
    )


def _probe_fields(probe: KVProbe | None) -> dict | None:
    """A probe's dicts as JSON pairs (JSON keys are strings; seq ids stay ints)."""
    if probe is None:
        return None
    return {key: list(getattr(probe, key).items()) for key in _PROBE_FIELDS}


def _probe_of(fields: dict | None) -> KVProbe | None:
    return None if fields is None else KVProbe(**{key: dict(fields[key])
                                                  for key in _PROBE_FIELDS})
