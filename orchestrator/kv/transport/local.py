"""An in-process transport with NIXL's semantics, for unit tests and one-process pipelines.

Nodes meet on a :class:`LocalFabric`. Copies are ``memmove`` between registered
regions and complete at post time; the target's notification is queued after
the copy, as NIXL delivers it after the data. Writing outside registered memory
or to a node that left the fabric fails the transfer, as it would over NIXL.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Sequence

import torch

from orchestrator.kv.transport.base import (
    KVPoll,
    Pair,
    Region,
    TransferHandle,
    Transport,
    check_pairs,
    tensor_region,
)


class LocalFabric:
    """The 'network' joining local transports by name."""

    def __init__(self) -> None:
        self._nodes: dict[str, LocalTransport] = {}
        self._lock = threading.Lock()

    def join(self, node: LocalTransport) -> None:
        with self._lock:
            if node.name in self._nodes:
                raise ValueError(f"a node named {node.name!r} is already on the fabric")
            self._nodes[node.name] = node

    def leave(self, name: str) -> None:
        """The node disappears (as a killed process would)."""
        with self._lock:
            self._nodes.pop(name, None)

    def lookup(self, name: str) -> LocalTransport | None:
        with self._lock:
            return self._nodes.get(name)


class LocalTransport(Transport):
    _ids = itertools.count()

    def __init__(self, fabric: LocalFabric, name: str | None = None) -> None:
        self.name = name or f"local-{next(self._ids)}"
        self.fabric = fabric
        self._regions: list[Region] = []
        self._peers: set[str] = set()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._lock = threading.Lock()
        fabric.join(self)

    def register(self, tensor: torch.Tensor) -> Region:
        region = tensor_region(tensor)
        self._regions.append(region)
        return region

    def deregister(self, tensor: torch.Tensor) -> None:
        self._regions.remove(tensor_region(tensor))

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        if metadata.decode() != name:
            raise ValueError(f"metadata is for {metadata.decode()!r}, not {name!r}")
        self._peers.add(name)

    def remove_peer(self, name: str) -> None:
        self._peers.discard(name)

    def owns(self, region: Region) -> bool:
        return any(
            r.addr <= region.addr and region.addr + region.nbytes <= r.addr + r.nbytes
            for r in self._regions
        )

    def _copy(self, peer: str, pairs: Sequence[Pair], notify: bytes, op: str) -> TransferHandle:
        handle = TransferHandle(peer, check_pairs(pairs))
        target = self.fabric.lookup(peer) if peer in self._peers else None
        if target is None:
            handle.fail(f"peer {peer!r} is not connected or has disconnected")
            return handle
        for local, remote in pairs:
            if not self.owns(local):
                handle.fail(f"local region {local} is not registered")
                return handle
            if not target.owns(remote):
                handle.fail(f"region {remote} is not registered on peer {peer!r}")
                return handle
        for local, remote in pairs:
            src, dst = (local, remote) if op == "WRITE" else (remote, local)
            ctypes.memmove(dst.addr, src.addr, src.nbytes)
        if notify:
            target.deliver(self.name, notify)
        handle.state = KVPoll.SUCCESS
        return handle

    def write(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        return self._copy(peer, pairs, notify, "WRITE")

    def read(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        return self._copy(peer, pairs, notify, "READ")

    def poll(self, handle: TransferHandle) -> KVPoll:
        return handle.state

    def notify(self, peer: str, message: bytes) -> None:
        target = self.fabric.lookup(peer) if peer in self._peers else None
        if target is None:
            raise ConnectionError(f"peer {peer!r} is not connected or has disconnected")
        target.deliver(self.name, message)

    def deliver(self, sender: str, message: bytes) -> None:
        with self._lock:
            self._inbox.append((sender, message))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def close(self) -> None:
        self.fabric.leave(self.name)
        self._regions.clear()
