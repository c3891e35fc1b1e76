"""A T-node's token service in a process of its own, which its Triton stub relays to.

Why: on a small model the token loop (the head, the stage, the engine's decode) is
Python-bound, and inside ``triton_python_backend_stub`` it ran 1.1-1.3x slower than in
the venv's own python: the stub embeds Debian's shared ``libpython3.11.so`` (the
venv's ``python3.11`` is linked statically) and shares its GIL with the stub's threads
and their IPC with tritonserver. vLLM v1 runs its engine core in a process of its own
for the same reason. Tokens leave the service through its token feed (TCP, straight to
the frontend), so the relay is on each request's path (admission, its KV ticket, its
last response), not on each token's; a request without a feed gets its tokens relayed.

The stub's side is :class:`ServiceProcess`, a drop-in for the
:class:`~orchestrator.serving.token_service.TokenService` that ``decode/model.py``
calls; the service's side is :func:`main`. They exchange pickled tuples over a socket
pair the stub made (nothing else can reach it):

- stub -> service: ``("call", id, method, args)`` (``admit``, ``control``,
  ``open_feed``), answered by ``("reply", id, error)``, where ``error`` is None or
  (code, message); ``("cancel", request id)``: Triton says its client left;
  ``("stop",)``.
- service -> stub: ``("ready",)`` or ``("failed", traceback)`` once, then replies and
  callbacks ``("emit" | "fail" | "ticket" | "close", request id, args)``, and
  ``("metrics", added, gauges)``.

The service ends when the socket closes: its stub is gone (tritonserver stopped, or the
node was killed).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from orchestrator.control.errors import ControlError, ErrorCode, code_of
from orchestrator.fault.client import report_lost
from orchestrator.serving.config import NodeConfig
from orchestrator.serving.control_request import ControlRequest, Emit
from orchestrator.serving.metrics import PublishedMetrics, Series
from orchestrator.serving.params import GenerationParams

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often the stub asks Triton which requests were cancelled
# ... of at most this many open requests in turn: each question is an IPC round trip, and
# 64 streams asked every 50 ms cost the stub as much as their tokens (the frontend ends its
# requests with an ``end`` op; this catches a client or a frontend gone). A few streams
# are each asked every 50 ms still; 64, each every 0.4 s.
CANCEL_CHECKS_PER_POLL = 8
# A request Triton cancelled gets no last answer (its stream is gone): forgotten this long
# after, by when its service ended it.
CANCELLED_KEPT_S = 10.0
CALL_TIMEOUT_S = 600.0  # a control op may replace a lost stage: seconds, never minutes


def _is_last(kind: str, args: tuple) -> bool:
    """A stream's last answer: a failure, a feed's close, or a final emit."""
    return kind in ("fail", "close") or (kind == "emit" and bool(args[2]))


class _Link:
    """One end of the socket pair; sends from any thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *message: object) -> None:
        with self._lock:
            self.conn.send(message)


@dataclass(eq=False)
class _Stream:
    """A request of the stub's whose answers the service sends back."""

    callbacks: dict[str, Callable[..., None]]
    is_cancelled: Callable[[], bool]
    cancelled_at: float | None = None  # when the service was told

    @property
    def is_feed(self) -> bool:
        return "close" in self.callbacks


# -- the stub's side ---------------------------------------------------------------------


class ServiceProcess:
    """Starts the service's process for the node configured by ``config_json``, and
    relays to it; ``metrics`` publishes what the service counts (Triton's metrics)."""

    def __init__(self, config_json: str, metrics: PublishedMetrics,
                 start_timeout_s: float = 600.0) -> None:
        self.metrics, self.config_json = metrics, config_json
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        self.link = _Link(Connection(ours.detach()))
        self._calls: dict[int, Future[bytes]] = {}
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # no request is freed by its last answer while polled
        self._ids = itertools.count()
        self._gone: str | None = None  # why the service cannot answer any more
        self._stopping = threading.Event()
        self.link.send("config", config_json)
        self._wait_ready(start_timeout_s)
        threading.Thread(target=self._read, name="service-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="cancel-watch", daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.link.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the token service did not start in {timeout_s:.0f} s "
                                   f"(exit code {self.process.poll()})")
        message = self.link.conn.recv()
        if message[0] != "ready":
            self.process.wait(10)
            raise RuntimeError(f"the token service failed to start:\n{message[1]}")

    # -- what decode/model.py calls (as on a TokenService) --------------------------------

    def admit(self, request_id: str, prompt_ids: list[int], params: GenerationParams,
              emit: Emit, fail: Callable[[str], None], is_cancelled: Callable[[], bool],
              send_ticket: Callable[[bytes], None], feed: str | None = None,
              kv_since: str | None = None) -> None:
        self._open(request_id, {"emit": emit, "fail": fail, "ticket": send_ticket},
                   is_cancelled, "admit", (request_id, prompt_ids, params, feed, kv_since))

    def open_feed(self, feed_id: str, listener: str, close_stream: Callable[[], None],
                  is_cancelled: Callable[[], bool]) -> None:
        """A token feed to the frontend's ``listener`` (host:port): the service connects."""
        self._open(feed_id, {"close": close_stream}, is_cancelled, "open_feed",
                   (feed_id, listener))

    def control(self, op: str, request: ControlRequest) -> bytes:
        return self._call("control", (op, request))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        try:
            self.link.send("stop")
            self.process.wait(timeout_s + 5.0)
        except (OSError, subprocess.TimeoutExpired):
            log.warning("the token service did not stop: killed")
            self.process.kill()
            self.process.wait(5.0)

    # -- calls and answers ------------------------------------------------------------

    def _open(self, request_id: str, callbacks: dict[str, Callable[..., None]],
              is_cancelled: Callable[[], bool], method: str, args: tuple) -> None:
        """A call that starts a stream of answers: they may come before its reply."""
        stream = _Stream(callbacks, is_cancelled)
        with self._lock:
            if request_id in self._streams:
                raise ControlError(ErrorCode.BAD_REQUEST,
                                   f"request id {request_id!r} is already running here")
            self._streams[request_id] = stream
        try:
            self._call(method, args)
        except BaseException:
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
            raise

    def _call(self, method: str, args: tuple) -> bytes:
        call_id, future = next(self._ids), Future()
        self._calls[call_id] = future
        try:
            if self._gone is not None:
                raise ControlError(ErrorCode.PIPELINE_LOST, self._gone)
            self.link.send("call", call_id, method, args)
            return future.result(CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self.link.conn.recv())
        except (EOFError, OSError):
            pass
        if self._stopping.is_set():
            self._lost("the node stopped")
            return
        self._lost("the node's token service exited")
        # The service's heartbeats ended with it: say so now, not after the timeout.
        config = NodeConfig.from_json(self.config_json)
        if config.controller and config.name:
            report_lost(config.controller, config.name, "its token service ended",
                        config.secret())

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "reply":
            _, call_id, result, error = message
            future = self._calls.get(call_id)
            if future is not None:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(ControlError(ErrorCode(error[0]), error[1]))
        elif kind == "metrics":
            self.metrics.publish(*message[1:])
        else:
            _, request_id, args = message
            # Its last answer: forget it first, so it is never asked whether it was
            # cancelled once Triton freed it (that crashes tritonserver).
            last = _is_last(kind, args)
            with self._lock:
                stream = (self._streams.pop(request_id, None) if last
                          else self._streams.get(request_id))
            if stream is None:  # cancelled by Triton, and forgotten since
                log.debug("an answer for %s, which is not open here", request_id)
                return
            try:
                stream.callbacks[kind](*args)
            except Exception:
                log.exception("could not answer request %s", request_id)

    def _lost(self, why: str) -> None:
        """The service is gone: every call and stream fails."""
        self._gone = why
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(ControlError(ErrorCode.PIPELINE_LOST, why))
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            try:
                if stream.is_feed:
                    stream.callbacks["close"]()
                elif stream.cancelled_at is None:  # a cancelled one's stream is gone
                    stream.callbacks["fail"](f"decode: {why}")
            except Exception:
                log.exception("could not end a request")

    def _watch(self) -> None:
        """Triton tells a request's cancellation only when asked: ask, tell the service.
        A stub can outlive its tritonserver (seen after a SIGABRT): its service then ends,
        so its heartbeats stop and the node is declared dead."""
        server, turn = os.getppid(), 0
        while not self._stopping.wait(CANCEL_POLL_S):
            if os.getppid() != server:
                log.error("tritonserver is gone: ending the token service")
                self.process.kill()
                return
            now = time.monotonic()
            with self._lock:
                running = [rid for rid, s in self._streams.items() if s.cancelled_at is None]
                asked = [running[(turn + i) % len(running)]
                         for i in range(min(len(running), CANCEL_CHECKS_PER_POLL))]
                turn = (turn + len(asked)) % max(1, len(running))
                cancelled = [rid for rid in asked if self._streams[rid].is_cancelled()]
                for request_id in cancelled:
                    self._streams[request_id].cancelled_at = now
                for request_id in [rid for rid, s in self._streams.items() if not s.is_feed
                                   and s.cancelled_at and now - s.cancelled_at > CANCELLED_KEPT_S]:
                    del self._streams[request_id]
            for request_id in cancelled:
                try:
                    self.link.send("cancel", request_id)
                except OSError:
                    return


# -- the service's side ------------------------------------------------------------------


class _RelayedMetrics(PublishedMetrics):
    def __init__(self, link: _Link) -> None:
        self.link = link
        super().__init__()

    def publish(self, added: dict[Series, float], gauges: dict[Series, float]) -> None:
        self.link.send("metrics", added, gauges)


class _Service:
    """Runs the stub's calls on the node's token service, one at a time, in order (a
    cancellation after the admission it cancels)."""

    def __init__(self, link: _Link, service, secret: bytes) -> None:  # noqa: ANN001
        self.link, self.service, self.secret = link, service, secret
        self.calls: queue.Queue[tuple | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="service-calls", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            call_id, method, args = call
            result, error = b"", None
            try:
                result = getattr(self, method)(*args) or b""
                if not isinstance(result, bytes):
                    raise TypeError(f"{method} answered {type(result).__name__}, not bytes")
            except Exception as exc:
                result, error = b"", (int(code_of(exc)), str(exc))
            if call_id is not None:
                self.link.send("reply", call_id, result, error)
            elif error is not None:
                log.warning("%s%s: %s", method, args, error[1])

    def _answers(self, request_id: str, kinds: tuple[str, ...]) -> list[Callable[..., None]]:
        def answer(kind: str) -> Callable[..., None]:
            return lambda *args: self.link.send(kind, request_id, args)

        return [answer(kind) for kind in kinds]

    def admit(self, request_id: str, prompt_ids: list[int], params: GenerationParams,
              feed: str | None, kv_since: str | None = None) -> None:
        emit, fail, ticket = self._answers(request_id, ("emit", "fail", "ticket"))
        self.service.admit(request_id, prompt_ids, params, emit, fail, ticket, feed, kv_since)

    def open_feed(self, feed_id: str, listener: str) -> None:
        from orchestrator.serving.feed import FeedSender

        (close,) = self._answers(feed_id, ("close",))
        self.service.open_feed(feed_id, FeedSender(listener, feed_id, self.secret), close)

    def cancel(self, request_id: str) -> None:
        self.service.cancel(request_id)

    def control(self, op: str, request: ControlRequest) -> bytes:
        return self.service.control(op, request)


def main(fd: int) -> None:
    from orchestrator.serving.node import connect_controller, load_token_service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    link = _Link(Connection(fd))
    try:
        _, config_json = link.conn.recv()
        config = NodeConfig.from_json(config_json)
        controller = connect_controller(config)
        service = load_token_service(config, _RelayedMetrics(link), controller)
    except Exception:
        link.send("failed", traceback.format_exc())
        return
    link.send("ready")
    calls = _Service(link, service, config.secret())
    try:
        while (message := link.conn.recv())[0] != "stop":
            if message[0] == "cancel":  # answered by nothing
                calls.calls.put((None, "cancel", message[1:]))
            else:
                calls.calls.put(message[1:])
    except (EOFError, OSError):
        log.warning("the stub is gone: stopping")
        if controller is not None:  # this node serves nothing any more: dead now
            controller.lost("its stub ended")
    calls.calls.put(None)
    calls.thread.join(CALL_TIMEOUT_S)
    if controller is not None:
        controller.stop()
    service.stop()
    link.conn.close()
    os._exit(0)  # the transports' threads must not hold the process


if __name__ == "__main__":
    main(int(sys.argv[1]))
