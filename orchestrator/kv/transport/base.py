"""The transport interface: one-sided WRITE/READ between registered host memory.

A backend moves bytes between *regions* (address, length) of memory that both
sides registered, and delivers a short notification to the target after the
data of the transfer it rides on has landed. Everything above (headers, slots,
routing) is transport-neutral and lives in the KV library.

Transfers are asynchronous: ``write``/``read`` post and return a handle;
``poll`` moves it through :class:`KVPoll` states. A failed post or a peer that
disappears shows up as ``FAILED`` with ``handle.error`` naming the peer, never
as an exception from ``poll`` and never as a hang.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KVPoll(enum.IntEnum):
    """Explicit transfer states (the SGLang disaggregation state machine)."""

    FAILED = 0
    BOOTSTRAPPING = 1  # peers being connected, nothing posted yet
    WAITING = 2  # reserved, waiting for the peer to send
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``addr`` in some process's registered memory."""

    addr: int
    nbytes: int

    def sub(self, offset: int, nbytes: int) -> Region:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) outside a region of {self.nbytes} B")
        return Region(self.addr + offset, nbytes)


def tensor_region(tensor: torch.Tensor) -> Region:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("transports move contiguous host (CPU) tensors only")
    return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size())


# (local region, remote region) of equal size: one piece of a transfer.
Pair = tuple[Region, Region]


class TransferHandle:
    """A posted transfer; backends subclass it to keep their own request."""

    def __init__(self, peer: str, nbytes: int) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.state = KVPoll.TRANSFERRING
        self.error: str | None = None

    def fail(self, error: str) -> None:
        self.state = KVPoll.FAILED
        self.error = error


class Transport(ABC):
    """One node's endpoint. ``name`` is what peers see in notifications."""

    name: str

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> Region:
        """Make a contiguous host tensor reachable by peers (call before ``metadata``)."""

    @abstractmethod
    def deregister(self, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` to reach this node."""

    @abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Connect to ``name``; a known name with new metadata (a restart) is replaced."""

    @abstractmethod
    def remove_peer(self, name: str) -> None: ...

    @abstractmethod
    def write(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        """Post local -> remote copies; ``notify`` reaches the peer after the data."""

    @abstractmethod
    def read(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        """Post remote -> local copies; ``notify`` reaches the peer after the data."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> KVPoll:
        """Advance and return the state; on FAILED, ``handle.error`` says why."""

    @abstractmethod
    def notify(self, peer: str, message: bytes) -> None:
        """A notification not tied to data (may overtake earlier transfers)."""

    @abstractmethod
    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(peer name, message)``, in arrival order per peer."""

    @abstractmethod
    def close(self) -> None: ...


def check_pairs(pairs: Sequence[Pair]) -> int:
    """Total bytes of ``pairs``; each local and remote piece must match in size."""
    if not pairs:
        raise ValueError("a transfer needs at least one (local, remote) pair")
    total = 0
    for local, remote in pairs:
        if local.nbytes != remote.nbytes or local.nbytes <= 0:
            raise ValueError(f"pair sizes differ or are empty: {local.nbytes} vs {remote.nbytes}")
        total += local.nbytes
    return total
