"""Where the profiler streams a prompt's KV to measure m: a real ``KVReceiver`` on a transport.

- ``nixl`` (what ``dejavu plan`` uses): the receiver lives in a child process, as
  on a decode node, and the KV crosses NIXL (UCX on loopback) between two agents.
- ``local``: the receiver shares this process over a ``LocalFabric`` (memmove),
  for unit tests and machines without NIXL.

The profiler sends with a ``KVSender`` on :attr:`KVSink.transport`; the
receiver validates every block, so a measured prefill is one whose KV landed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import torch

from orchestrator.kv.connector import KVReceiver
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.base import Transport
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.layout import KVLayout

TRANSPORTS = ("nixl", "local")
SECRET = b"dejavu-plan-profile"
RECEIVER = "plan-receiver"  # the receiver's node name on either transport
STARTUP_S = 120  # spawning the child imports torch and starts a UCX agent: slow on shared cores


def _serve(receiver: KVReceiver, kind: str, request_id: str, prompt_len: int) -> bytes:
    """``reserve`` (a ticket) or ``collect``; every error a KVTransferError naming a peer."""
    try:
        if kind == "reserve":
            return receiver.reserve(request_id, prompt_len)
        try:
            receiver.wait(request_id)
        finally:
            receiver.release(request_id)
        return b""
    except KVTransferError:
        raise
    except (ValueError, RuntimeError) as exc:  # a bad or a second reserve, no free slot
        raise KVTransferError(receiver.transport.name, str(exc), request_id) from exc


def _receiver_main(inbox: mp.Queue, outbox: mp.Queue, layout: dict, slots: int, timeout_s: float):
    """The child: serve requests until told to stop or the parent is gone."""
    from orchestrator.kv.transport.nixl import NixlTransport

    torch.set_num_threads(1)
    transport = NixlTransport(name=RECEIVER)
    receiver = KVReceiver(transport, KVLayout(**layout), slots, SECRET, timeout_s=timeout_s)
    outbox.put(b"up")
    parent = mp.parent_process()
    while parent is not None and parent.is_alive():
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        if message is None:
            break
        try:
            outbox.put(_serve(receiver, *message))
        except KVTransferError as exc:  # its pickling loses the fields: send them
            outbox.put((exc.peer, exc.reason))
    transport.close()


class KVSink:
    """A receiver of ``num_slots`` prompts of ``layout`` behind ``transport_kind``."""

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        transport_kind: str = "nixl",
        timeout_s: float = 60.0,
    ) -> None:
        if transport_kind not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {transport_kind!r}; choose from {', '.join(TRANSPORTS)}"
            )
        self.kind, self.timeout_s = transport_kind, timeout_s
        self.transport: Transport  # the sending end, in this process
        if transport_kind == "local":
            fabric = LocalFabric()
            self.transport = LocalTransport(fabric, "plan-sender")
            self._receiver = KVReceiver(
                LocalTransport(fabric, RECEIVER), layout, num_slots, SECRET, timeout_s
            )
            return
        from orchestrator.kv.transport.nixl import NixlTransport

        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=_receiver_main,
            args=(self._inbox, self._outbox, layout.to_dict(), num_slots, timeout_s),
            daemon=True,
        )
        self._process.start()
        self.transport = NixlTransport(name="plan-sender")
        try:
            self._answer("start-up", STARTUP_S)  # tickets will carry the receiver's metadata
        except KVTransferError:
            self.close()
            raise

    @property
    def description(self) -> str:
        return "nixl, 2 processes" if self.kind == "nixl" else "local, 1 process"

    def reserve(self, request_id: str, prompt_len: int) -> bytes:
        """A ticket for a prompt of ``prompt_len``, to hand to ``KVSender.start``."""
        return self._request("reserve", request_id, prompt_len)

    def collect(self, request_id: str) -> None:
        """Wait until the prompt's KV landed and verified, then free its slot."""
        self._request("collect", request_id, 0)

    def _request(self, kind: str, request_id: str, prompt_len: int) -> bytes:
        if self.kind == "local":
            return _serve(self._receiver, kind, request_id, prompt_len)
        self._inbox.put((kind, request_id, prompt_len))
        reply = self._answer(kind, self.timeout_s + 10, request_id)  # the receiver times out first
        if isinstance(reply, tuple):  # the receiver's error: (peer, reason)
            raise KVTransferError(*reply, request_id)
        return reply

    def _answer(self, what: str, wait_s: float, request_id: str | None = None):
        """The child's next message; fails at once if it died, after ``wait_s`` if silent."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._outbox.get(timeout=0.5)
            except queue.Empty:
                if not self._process.is_alive():
                    why = f"exited with code {self._process.exitcode}"
                elif time.monotonic() > deadline:
                    why = f"did not answer {what} in {wait_s:.0f} s"
                else:
                    continue
                raise KVTransferError(RECEIVER, f"receiver process {why}", request_id) from None

    def close(self) -> None:
        if self.kind == "local":
            self._receiver.close()
            self._receiver.transport.close()
        else:
            self._inbox.put(None)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        self.transport.close()

    def __enter__(self) -> KVSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
