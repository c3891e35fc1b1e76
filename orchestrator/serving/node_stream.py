"""One gRPC stream from the frontend to a token pipeline's stage 0, for all its requests there.

A stream per request costs a gRPC call's setup and teardown and a tritonclient
thread while it lasts. A :class:`NodeStream` keeps one stream to the T-node:
every generate and ``end`` request of this frontend goes on it, and each
response goes to its request's queue by request id. The tokens do not come as
Triton responses: the stream opens a *token feed* (the decode model's ``feed``
op) to the frontend's :class:`~orchestrator.serving.feed.FeedListener`, and the
T-node pushes one message per pipeline step with the tokens of every request
the step advanced. A request's own responses are its KV ticket, its failure
and its last (empty) response; it is done once both that and the feed's word
that its tokens are done have come, in either order (they travel apart).

Once a request streams (:meth:`RequestStream.forward`), the listener's thread
hands each feed message's tokens to every request it names, one after another,
instead of queueing them for each request's own thread: waking 64 threads a
step, each taking the GIL in turn, cost the frontend as much as the responses
themselves (py-spy; 0.16 ms a token with 4 tokens per response). The request's
thread waits only for its end: its last tokens, its last response, a failure,
or its client leaving.

The stream breaking (the node died or was started again) fails every request on
it, and the next request opens a new one. Nothing on it is ever cancelled: a
request whose client left is ended with a signed ``end`` op (Triton 2.51 races a
cancellation against a response: server issues 7368 and 8034).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrator.control.auth import request_parameters
from orchestrator.control.client import connect, raise_for_error, stop_stream, tensor
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.serving.feed import FeedListener, FeedRow

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often a waiting request asks Triton whether its client left
# ... and one waiting for its tokens: each question is an IPC round trip to tritonserver that
# holds the stub's GIL, and asked every 50 ms by 64 streams it cost as much as their tokens'
# responses (py-spy); a client that left is noticed within this, its slot freed then (at
# 0.25 s a tiny model's 240-token stream often ran to its end before its stop was seen).
TOKEN_CANCEL_POLL_S = 0.1


class Cancelled(Exception):
    """The client went away; downstream work has been ended."""


class StreamTimeout(TimeoutError):
    """The node sent nothing at all, to any request, for a request's whole timeout."""


@dataclass
class _Tokens:
    """A feed's tokens for one request."""

    ids: list[int]
    log_probs: list[TokenLogProb] | None
    done: bool


# a request's new tokens and their log-probs (None: not asked for), on the listener's thread
Forward = Callable[[list[int], list[TokenLogProb] | None], None]


@dataclass(eq=False)
class _Forwarding:
    """Where the feed's tokens for one request go as they come; ``lock`` is held while
    they are handed on, so a request that stops forwarding has none in flight after."""

    relay: Forward | None  # None once it failed
    responses: queue.SimpleQueue  # where a failure of ``relay`` goes
    lock: threading.Lock = field(default_factory=threading.Lock)


class NodeStream:
    """One stream to a T-node's ``decode`` model and the token feed on it."""

    def __init__(self, url: str, secret: bytes, listener: FeedListener) -> None:
        """``listener``: where the T-node pushes the feed's tokens (the frontend's one)."""
        self.url, self.secret, self.listener = url, secret, listener
        self.feed_id = f"feed-{uuid.uuid4().hex}"
        self.broken: Exception | None = None
        # When the node last sent anything: a request queued for a slot in a full batch
        # hears nothing of its own for as long as the batch runs, yet is not lost.
        self.heard_at = time.monotonic()
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._forwards: dict[str, _Forwarding] = {}
        self._lock = threading.Lock()
        self._feed_ended = threading.Event()
        listener.subscribe(self.feed_id, self._deliver, lambda: self._break(
            ConnectionError(f"decode node {url}: its token feed's connection dropped")))
        self._client = connect(url)  # its own channel: a node started again is reached at once
        self._client.start_stream(callback=self._dispatch)
        self.send(self.feed_id, "feed",
                  {"peers": np.array([listener.address.encode()], dtype=np.object_)})

    def open(self, request_id: str, timeout_s: float) -> RequestStream:
        with self._lock:
            if self.broken is not None:
                raise self.broken
            responses = self._queues[request_id] = queue.SimpleQueue()  # C: cheap wake-ups
        return RequestStream(self, request_id, responses, timeout_s)

    def forget(self, request_id: str) -> None:
        self.stop_forwarding(request_id)
        with self._lock:
            self._queues.pop(request_id, None)

    def forward(self, request_id: str, relay: Forward) -> tuple[_Forwarding | None, list]:
        """From now on the feed's tokens for ``request_id`` that do not end it go to
        ``relay`` on the listener's thread. Returns its forwarding, its lock taken (the
        listener waits until the caller releases it), and what its queue held meanwhile,
        in order, for the caller to hand on first (None and nothing: it was forgotten)."""
        with self._lock:
            responses = self._queues.get(request_id)
            if responses is None:
                return None, []
            forwarding = self._forwards[request_id] = _Forwarding(relay, responses)
            forwarding.lock.acquire()
            queued = []
            while not responses.empty():
                queued.append(responses.get())
        return forwarding, queued

    def stop_forwarding(self, request_id: str) -> None:
        """No token of ``request_id`` is handed on after this returns."""
        with self._lock:
            forwarding = self._forwards.pop(request_id, None)
        if forwarding is not None:
            with forwarding.lock:  # one in flight ends first
                pass

    def send(self, request_id: str, op: str, arrays: dict[str, np.ndarray]) -> None:
        """A signed request on the stream; raises the stream's error if it is broken."""
        if op != "generate":
            arrays = {"op": np.array([op.encode()], dtype=np.object_), **arrays}
        try:
            self._client.async_stream_infer(
                "decode", [tensor(k, v) for k, v in arrays.items()], request_id=request_id,
                enable_empty_final_response=True,
                parameters=request_parameters(self.secret, "decode", op, request_id, self.url,
                                              arrays))
        except InferenceServerException as exc:
            # A broken stream says why through the callback, not in this exception.
            raise self._wait_broken(exc) from None

    def _wait_broken(self, fallback: Exception, wait_s: float = 1.0) -> Exception:
        deadline = time.monotonic() + wait_s
        while self.broken is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.broken is None:
            self._break(fallback)
        return self.broken

    def _dispatch(self, result: grpcclient.InferResult | None, error: Exception | None) -> None:
        """On tritonclient's stream thread: hand each response to its request."""
        self.heard_at = time.monotonic()
        if error is not None:  # tritonclient gives no request id with one: the stream is lost
            self._break(error)
            return
        request_id = result.get_response().id
        if request_id != self.feed_id:
            self._put(request_id, result)
            return
        # The feed refused, its own final response, or the ``end`` op's reply.
        try:
            raise_for_error(result, f"decode node {self.url} (token feed)")
        except Exception as exc:
            self._break(exc)
        if result.as_numpy("reply") is None:
            self._feed_ended.set()

    def _deliver(self, rows: list[FeedRow]) -> None:
        """On the listener's thread: the feed's tokens of one step, handed on to the
        requests that forward them, queued for the others (and each request's last)."""
        self.heard_at = time.monotonic()
        forwarded = []
        with self._lock:  # queued or forwarded, never both: see forward()
            for rid, tokens, log_probs, done in rows:
                forwarding = None if done else self._forwards.get(rid)
                if forwarding is not None:
                    forwarded.append((forwarding, tokens, log_probs))
                elif (responses := self._queues.get(rid)) is not None:
                    responses.put(_Tokens(tokens, log_probs, done))
        for forwarding, tokens, log_probs in forwarded:
            with forwarding.lock:
                if forwarding.relay is None:
                    continue  # it failed: the request ends with that failure
                try:
                    forwarding.relay(tokens, log_probs)
                except Exception as exc:  # the request's own thread raises it
                    forwarding.relay = None
                    forwarding.responses.put(exc)

    def _put(self, request_id: str, item: object) -> None:
        with self._lock:
            responses = self._queues.get(request_id)
        if responses is not None:  # else forgotten: a request that ended or was ended
            responses.put(item)

    def _break(self, error: Exception) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            waiting = list(self._queues.values())
        for responses in waiting:
            responses.put(error)

    def close(self, wait_s: float = 2.0) -> None:
        """End the feed and wait for its final response (Triton releases a request only
        then), then the stream; requests still on it fail."""
        if self.broken is None:
            try:
                self.send(self.feed_id, "end", {})
                self._feed_ended.wait(wait_s)
            except Exception:  # the node is gone: nothing left to end
                log.debug("could not end the token feed to %s", self.url, exc_info=True)
        self._break(ConnectionError(f"stream to {self.url} closed"))
        self.listener.unsubscribe(self.feed_id)
        try:
            stop_stream(self._client, cancel=True)
        finally:
            self._client.close()


@dataclass
class RequestStream:
    """One request on a :class:`NodeStream`: its responses and its feed's tokens."""

    node: NodeStream
    request_id: str
    responses: queue.SimpleQueue
    timeout_s: float
    _cancel_check_at: float = 0.0
    _fed_done: bool = False  # the feed said its tokens are done
    _final: bool = False  # its own last response came
    _held: list = field(default_factory=list)  # taken from the queue, not yet handed out
    cached_tokens: int = 0  # colocated: the prompt's tokens the node's prefix cache held
    kv_events: bytes | None = None  # colocated: its cache's events for a KV-aware router

    def send(self, arrays: dict[str, np.ndarray]) -> None:
        self.node.send(self.request_id, "generate", {
            **arrays, "feed": np.array([self.node.feed_id.encode()], dtype=np.object_)})

    def forward(self, relay: Forward) -> None:
        """Hand every token of this request from now on to ``relay`` as it comes, on the
        feed listener's thread, but its last ones (:meth:`tokens` returns those); what
        came before goes to ``relay`` first, here. A failure of ``relay`` is raised by
        :meth:`tokens`; :meth:`close` stops it."""
        forwarding, queued = self.node.forward(self.request_id, relay)
        items, self._held = self._held + queued, []
        try:
            for item in items:
                if isinstance(item, _Tokens) and not item.done:
                    relay(item.ids, item.log_probs)
                else:  # its last tokens, a response or a failure: tokens() takes them
                    self._held.append(item)
        except BaseException:
            if forwarding is not None:
                forwarding.relay = None
            raise
        finally:
            if forwarding is not None:
                forwarding.lock.release()

    def next(self, is_cancelled: Callable[[], bool]) -> grpcclient.InferResult:
        """The next response on the request's own stream (its ticket, its failure raised)."""
        while True:
            item = self._take(is_cancelled)
            if isinstance(item, _Tokens):
                self._held.append(item)
            else:
                return self._checked(item)

    def tokens(self, is_cancelled: Callable[[], bool]
               ) -> tuple[list[int], list[TokenLogProb] | None, bool]:
        """The tokens that came since the last call (at least one unless it is done), their
        log-probs (None: not asked for), and whether the request is done. Raises a
        failure (a ControlError for one the node answered), Cancelled, or StreamTimeout."""
        tokens: list[int] = []
        log_probs: list[TokenLogProb] | None = None
        while not (self._fed_done and self._final):
            if tokens and not self._fed_done and not self._held and self.responses.empty():
                break  # hand these out now: more may take a step (once done, its final
                # response is right behind: the last tokens go out with the final flag)
            item = self._held.pop(0) if self._held else self._take(is_cancelled)
            if isinstance(item, _Tokens):
                tokens += item.ids
                if item.log_probs is not None:
                    log_probs = (log_probs or []) + item.log_probs
                self._fed_done |= item.done
            else:
                self._checked(item)
        return tokens, log_probs, self._fed_done and self._final

    def end(self) -> None:
        """Have the node end the request (its client left, or it failed here): the head
        drops it and frees its slot, KV and replicas on every stage."""
        try:
            self.node.send(self.request_id, "end", {})
        except Exception:  # a broken stream: the node already lost the request with it
            log.debug("could not end %s on %s", self.request_id, self.node.url, exc_info=True)

    def stop_forwarding(self) -> None:
        """No token is handed on from the feed's thread after this returns."""
        self.node.stop_forwarding(self.request_id)

    def close(self) -> None:
        self.node.forget(self.request_id)

    def _take(self, is_cancelled: Callable[[], bool]) -> object:
        """The next item from the queue; asking Triton whether the client left costs a
        round trip, so that is asked every ``TOKEN_CANCEL_POLL_S`` at most."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = time.monotonic()
            if now >= self._cancel_check_at:
                self._cancel_check_at = now + TOKEN_CANCEL_POLL_S
                if is_cancelled():
                    raise Cancelled()
            if now >= deadline:
                deadline = self.node.heard_at + self.timeout_s  # still stepping: keep waiting
            if now >= deadline:
                raise StreamTimeout(f"decode node {self.node.url} sent nothing at all for "
                                    f"{self.timeout_s:.0f} s")
            try:
                item = self.responses.get(timeout=min(deadline, self._cancel_check_at) - now)
            except queue.Empty:
                continue
            if isinstance(item, Exception):
                raise item
            return item

    def _checked(self, result: grpcclient.InferResult) -> grpcclient.InferResult:
        raise_for_error(result, f"decode node {self.node.url}")
        self._final |= result.get_response().parameters["triton_final_response"].bool_param
        cached = result.as_numpy("cached_tokens")  # its last response's, colocated
        if cached is not None:
            self.cached_tokens = int(cached.reshape(-1)[0])
        events = result.as_numpy("kv_events")
        if events is not None:
            self.kv_events = events.reshape(-1)[0]
        return result
