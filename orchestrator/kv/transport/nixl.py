"""NIXL (UCX backend) transport: one NIXL agent per node, host (DRAM) memory.

Settings follow what was measured on this machine (shared/notes/nixl-on-cpu.md):
UCX stays on loopback unless told otherwise (``UCX_NET_DEVICES=lo``), uses
``tcp,sm`` (``tcp`` is needed for peer error handling, ``sm`` is ~2.5x faster),
and the progress thread sleeps ``progress_delay_us`` between polls instead of
busy-spinning a core, which the Python API hard-codes.

NIXL raises (``nixlRemoteDisconnectError``, ``nixlNotFoundError``, ...) rather
than reporting ``ERR`` when a peer dies or a region is not registered; every
such exception becomes a ``FAILED`` handle whose error names the peer.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence

import numpy as np
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

# UCX reads these once, when the first agent in the process starts.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,sm")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from nixl_cu12 import _api as nixl_api  # noqa: E402  (after the UCX environment)

_bindings = nixl_api.nixlBind
_agent_creation = threading.Lock()
PROGRESS_DELAY_US = 1000
# A T-stage's prompt-KV transport (``<node>-kv``) wakes less often: its progress thread
# shares the token loop's core, and waking every 1 ms preempted the loop 3.6 times a token
# on a disaggregated T-node (1.3 at 10 ms, with no later first token: the head's KV probes
# poll its notifications themselves).
PROMPT_KV_PROGRESS_DELAY_US = 10_000


def _agent(name: str, progress_delay_us: int) -> nixl_api.nixl_agent:
    """A UCX agent whose progress thread sleeps instead of spinning.

    ``nixl_agent`` sets ``pthrDelay = 0`` on the bindings' config object just
    before creating the agent; a config subclass that pins the value is the
    only way in without re-implementing the wrapper.
    """
    base = _bindings.nixlAgentConfig

    class PinnedDelay(base):
        @property
        def pthrDelay(self) -> int:  # noqa: N802  (the bindings' name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, progress_delay_us)

    with _agent_creation:
        _bindings.nixlAgentConfig = PinnedDelay
        try:
            return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))
        finally:
            _bindings.nixlAgentConfig = base


def _descs(regions: Sequence[Region]) -> np.ndarray:
    return np.array([(r.addr, r.nbytes, 0) for r in regions], dtype=np.uint64).reshape(-1, 3)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class NixlHandle(TransferHandle):
    def __init__(self, peer: str, nbytes: int) -> None:
        super().__init__(peer, nbytes)
        self.request: nixl_api.nixl_xfer_handle | None = None


class NixlTransport(Transport):
    def __init__(self, name: str | None = None,
                 progress_delay_us: int = PROGRESS_DELAY_US) -> None:
        self.name = name or f"kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = _agent(self.name, progress_delay_us)
        self._registered: dict[Region, object] = {}
        self._peers: dict[str, bytes] = {}
        # The agent is created without NIXL's own locking (no listener thread):
        # one lock serialises the streamer thread and the caller's thread.
        self._lock = threading.RLock()

    def register(self, tensor: torch.Tensor) -> Region:
        region = tensor_region(tensor)
        with self._lock:
            self._registered[region] = self._agent.register_memory(
                [(region.addr, region.nbytes, 0, "")], "DRAM"
            )
        return region

    def deregister(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._agent.deregister_memory(self._registered.pop(tensor_region(tensor)))

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def add_peer(self, name: str, metadata: bytes) -> None:
        with self._lock:
            if self._peers.get(name) == metadata:
                return
            if name in self._peers:  # restarted under the same name
                self._agent.remove_remote_agent(name)
                del self._peers[name]
            loaded = self._agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"metadata belongs to agent {loaded!r}, expected {name!r}")
            self._peers[name] = metadata

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if self._peers.pop(name, None) is not None:
                self._agent.remove_remote_agent(name)

    def _post(self, handle: NixlHandle, make_request) -> NixlHandle:
        with self._lock:
            try:
                handle.request = make_request()
                status = self._agent.transfer(handle.request)
            except Exception as exc:  # the bindings' nixl*Error types
                handle.fail(f"posting to peer {handle.peer!r} failed: {_describe(exc)}")
                return handle
            if status == "ERR":
                handle.fail(f"posting to peer {handle.peer!r} failed")
            elif status == "DONE":
                self._finish(handle)
        return handle

    def _transfer(self, op: str, peer: str, pairs: Sequence[Pair], notify: bytes):
        handle = NixlHandle(peer, check_pairs(pairs))
        local = _descs([p[0] for p in pairs])
        remote = _descs([p[1] for p in pairs])

        def request():
            return self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                peer,
                notify,
            )

        return self._post(handle, request)

    def write(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        return self._transfer("WRITE", peer, pairs, notify)

    def read(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        return self._transfer("READ", peer, pairs, notify)

    def _finish(self, handle: NixlHandle) -> None:
        handle.state = KVPoll.SUCCESS
        if handle.request is not None:
            handle.request.release()
            handle.request = None

    def poll(self, handle: TransferHandle) -> KVPoll:
        assert isinstance(handle, NixlHandle)
        if handle.state != KVPoll.TRANSFERRING:
            return handle.state
        with self._lock:
            try:
                status = self._agent.check_xfer_state(handle.request)
            except Exception as exc:
                handle.fail(f"transfer to peer {handle.peer!r} failed: {_describe(exc)}")
                return handle.state
            if status == "DONE":
                self._finish(handle)
            elif status == "ERR":
                handle.fail(f"transfer to peer {handle.peer!r} reported an error")
        return handle.state

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                raise ConnectionError(f"notifying peer {peer!r}: {_describe(exc)}") from exc

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            new = self._agent.get_new_notifs()
        return [
            (peer.decode() if isinstance(peer, bytes) else peer, msg)
            for peer, msgs in new.items()
            for msg in msgs
        ]

    def close(self) -> None:
        with self._lock:
            for name in list(self._peers):
                self.remove_peer(name)
            for descs in self._registered.values():
                self._agent.deregister_memory(descs)
            self._registered.clear()


def stage_transport(name: str) -> NixlTransport:
    """A T-stage's transport named ``name``: ``<node>-kv`` (prompt KV from P-nodes) with
    ``PROMPT_KV_PROGRESS_DELAY_US``, the others (stage links, replicas) the default."""
    slow = name.endswith("-kv")
    return NixlTransport(name, PROMPT_KV_PROGRESS_DELAY_US if slow else PROGRESS_DELAY_US)
