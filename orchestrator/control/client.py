"""Calls to T-nodes and P-nodes over Triton gRPC: pooled connections, signed requests.

A control request goes to a T-node's ``decode`` model with ``op`` (its name)
and ``peers`` (its arguments) and gets one final ``reply``; a failure comes
back as ``error_code`` and ``error`` (:mod:`orchestrator.control.errors`).
Every request is signed (:func:`orchestrator.control.auth.request_parameters`).
A tritonclient client holds one stream at a time, so a call borrows one from
the :class:`ClientPool` and gives it back: connections are made once per node,
not once per call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrator.control.auth import request_parameters
from orchestrator.control.errors import ControlError, ErrorCode

_TRITON_DTYPES = {np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64", np.bool_: "BOOL"}


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    dtype = "BYTES" if array.dtype == np.object_ else _TRITON_DTYPES[array.dtype.type]
    inferred = grpcclient.InferInput(name, list(array.shape), dtype)
    inferred.set_data_from_numpy(array)
    return inferred


# A node that comes back is reached within a second: gRPC's default reconnect backoff
# grows to two minutes, which kept a restarted P-node out of use for 30 s.
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def connect(url: str) -> grpcclient.InferenceServerClient:
    """A Triton gRPC client that retries a lost node at least every second."""
    return grpcclient.InferenceServerClient(url, channel_args=_CHANNEL_ARGS)


def stop_stream(client: grpcclient.InferenceServerClient, cancel: bool) -> None:
    """End ``client``'s stream; ``cancel``: cancel what is in flight. tritonclient (2.51)
    cancels the gRPC call but never ends its request iterator, whose thread then waits for
    a next request forever: one thread leaked per cancelled stream (the frontend's
    orchestrator stub grew by one per client that left). Ending the iterator frees it."""
    stream = client._stream  # noqa: SLF001  (tritonclient keeps no public handle on it)
    client.stop_stream(cancel_requests=cancel)
    if cancel and stream is not None:
        stream._request_queue.put(None)  # noqa: SLF001  (the iterator's end marker)


def is_unreachable(error: Exception) -> bool:
    """The node could not be reached (gRPC status UNAVAILABLE): down, or died mid-call."""
    return (isinstance(error, InferenceServerException)
            and error.status() == "StatusCode.UNAVAILABLE")


def raise_for_error(result: grpcclient.InferResult, where: str) -> None:
    """Raise the :class:`ControlError` a failure response carries."""
    code = result.as_numpy("error_code")
    if code is not None:
        message = result.as_numpy("error")
        text = "" if message is None else message.reshape(-1)[0].decode(errors="replace")
        raise ControlError(ErrorCode(int(code.reshape(-1)[0])), f"{where}: {text}")


class ClientPool:
    """Idle gRPC clients per node url, made on first use and reused."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep  # idle clients kept per url; more are closed when given back
        self._idle: dict[str, list[grpcclient.InferenceServerClient]] = {}
        self._lock = threading.Lock()

    def take(self, url: str) -> grpcclient.InferenceServerClient:
        with self._lock:
            idle = self._idle.get(url)
            if idle:
                return idle.pop()
        return connect(url)

    def give(self, url: str, client: grpcclient.InferenceServerClient) -> None:
        with self._lock:
            idle = self._idle.setdefault(url, [])
            if len(idle) < self.keep:
                idle.append(client)
                return
        client.close()

    @contextmanager
    def borrow(self, url: str) -> Iterator[grpcclient.InferenceServerClient]:
        client = self.take(url)
        try:
            yield client
        except BaseException:
            client.close()  # its stream may be in any state
            raise
        self.give(url, client)

    def forget(self, url: str) -> None:
        """Close the idle clients of ``url`` (their connections may be to a node now gone)."""
        with self._lock:
            clients = self._idle.pop(url, [])
        for client in clients:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for client in clients:
            client.close()


class _Unsent(Exception):
    """The request never left: its stream had already ended (``error`` says why)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _stream_error(responses: queue.Queue, fallback: Exception) -> Exception:
    """The error an ended stream gave its callback (UNAVAILABLE: the node is unreachable)."""
    try:
        _, error = responses.get(timeout=1.0)
    except queue.Empty:
        return fallback
    return error or fallback


class ControlClient:
    """Signed control requests to T-nodes (and warm P spares): ``call(url, op, args)``
    returns the reply."""

    def __init__(self, secret: bytes, timeout_s: float, pool: ClientPool | None = None) -> None:
        self.secret, self.timeout_s = secret, timeout_s
        self.pool = pool or ClientPool()

    def call(self, url: str, op: str, args: Sequence[bytes] = (), request_id: str = "",
             prompt_ids: list[int] | None = None, model: str = "decode") -> bytes:
        """``model``: the node's model that answers (``prefill`` on a P-node)."""
        arrays = {"op": np.array([op.encode()], dtype=np.object_)}
        if prompt_ids:
            arrays["input_ids"] = np.array(prompt_ids, dtype=np.int32)
        if args:
            arrays["peers"] = np.array(list(args), dtype=np.object_)
        try:
            return self._call(url, op, arrays, request_id, model)
        except _Unsent:
            # A pooled connection to a node that was started again may still be waiting out
            # its reconnect backoff (its stream fails before the request is sent): once more,
            # on a new connection.
            self.pool.forget(url)
            try:
                return self._call(url, op, arrays, request_id, model)
            except _Unsent as exc:
                raise exc.error from None

    def _call(self, url: str, op: str, arrays: dict[str, np.ndarray], request_id: str,
              model: str) -> bytes:
        responses: queue.Queue = queue.Queue()
        with self.pool.borrow(url) as client:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            answered = False
            try:
                try:
                    client.async_stream_infer(
                        model, [tensor(k, v) for k, v in arrays.items()],
                        request_id=request_id,
                        parameters=request_parameters(self.secret, model, op, request_id,
                                                      url, arrays))
                except InferenceServerException as exc:  # the stream ended before the send
                    raise _Unsent(_stream_error(responses, exc)) from None
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"{model} node {url}: no answer to {op!r} within "
                                       f"{self.timeout_s:.0f} s") from None
                answered = True
            finally:  # waiting for a silent node's stream to end would never return
                stop_stream(client, cancel=not answered)
        if error is not None:
            raise error
        raise_for_error(result, f"{model} node {url} ({op})")
        return result.as_numpy("reply").reshape(-1)[0]

    def close(self) -> None:
        self.pool.close()
