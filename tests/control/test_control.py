"""The control plane without Triton: the secret file, request signatures, error codes, and the
gRPC client's streams (pooled, cancelled)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from orchestrator.control.auth import (
    ENV,
    Unauthenticated,
    check_request,
    load_secret,
    new_secret,
    request_parameters,
    sign,
    verify,
    write_secret,
)
from orchestrator.control.client import tensor
from orchestrator.control.errors import ControlError, ErrorCode, code_of
from orchestrator.kv.errors import KVTransferError, NoFreeSlot

SECRET = new_secret()


def test_secret_file_is_private_and_refused_when_others_may_read_it(tmp_path, monkeypatch):
    path = write_secret(tmp_path / "run" / "secret", SECRET)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_secret(path) == SECRET
    os.chmod(path, 0o644)
    with pytest.raises(Unauthenticated, match="readable by others"):
        load_secret(path)
    monkeypatch.setenv(ENV, SECRET.hex())
    assert load_secret() == SECRET
    monkeypatch.delenv(ENV)
    with pytest.raises(Unauthenticated, match="no cluster secret"):
        load_secret()


def test_a_signature_binds_its_parts_the_secret_and_the_time():
    signature = sign(SECRET, "decode", "reserve", "r1", now=1000)
    verify(SECRET, signature, "decode", "reserve", "r1", now=1010)
    for secret, parts, now in [(new_secret(), ("decode", "reserve", "r1"), 1010),
                               (SECRET, ("decode", "release", "r1"), 1010),
                               (SECRET, ("decode", "reserver1", ""), 1010)]:
        with pytest.raises(Unauthenticated, match="bad request signature"):
            verify(secret, signature, *parts, now=now)
    with pytest.raises(Unauthenticated, match="stale"):
        verify(SECRET, signature, "decode", "reserve", "r1", now=1000 + 3600)
    for missing in (None, ""):
        with pytest.raises(Unauthenticated, match="unsigned"):
            verify(SECRET, missing, "x")
    with pytest.raises(Unauthenticated, match="malformed"):
        verify(SECRET, "nonsense", "x")


def test_triton_request_parameters_round_trip():
    import json

    parameters = json.dumps(request_parameters(SECRET, "prefill", "prefill", "r7"))
    check_request(SECRET, parameters, "prefill", "prefill", "r7")
    for bad in ("", "{}", "[1]", '{"auth": 3}', "not json"):
        with pytest.raises(Unauthenticated):
            check_request(SECRET, bad, "prefill", "prefill", "r7")
    with pytest.raises(Unauthenticated):  # another request's signature
        check_request(SECRET, parameters, "prefill", "prefill", "r8")


def test_error_codes_come_from_exception_types_not_messages():
    assert code_of(NoFreeSlot("anything")) is ErrorCode.NO_FREE_SLOT
    assert code_of(KVTransferError("p", "why")) is ErrorCode.KV_TRANSFER
    assert code_of(Unauthenticated("who")) is ErrorCode.UNAUTHENTICATED
    assert code_of(ValueError("no free KV slot")) is ErrorCode.BAD_REQUEST  # words mean nothing
    assert code_of(RuntimeError("KV transfer (")) is ErrorCode.INTERNAL
    wrapped = ValueError("refused")
    wrapped.__cause__ = NoFreeSlot("full")
    assert code_of(wrapped) is ErrorCode.NO_FREE_SLOT
    assert code_of(ControlError(ErrorCode.PIPELINE_LOST, "x")) is ErrorCode.PIPELINE_LOST


def test_the_frontend_acts_on_codes_and_grpc_status_only():
    from tritonclient.utils import InferenceServerException

    from orchestrator.serving.frontend import NodeBusy, PipelineLost, ServingError, _decode_error

    busy = _decode_error(ControlError(ErrorCode.NO_FREE_SLOT, "full"), "t", admitted=False)
    assert type(busy) is NodeBusy
    refused = ControlError(ErrorCode.BAD_REQUEST, "no free KV slot, UNAVAILABLE")
    assert type(_decode_error(refused, "t", admitted=False)) is ServingError
    assert type(_decode_error(refused, "t", admitted=True)) is PipelineLost
    gone = InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE")
    assert type(_decode_error(gone, "t", admitted=False)) is PipelineLost
    worded = InferenceServerException("UNAVAILABLE", status="StatusCode.INTERNAL")
    assert type(_decode_error(worded, "t", admitted=False)) is ServingError


# -- a pooled connection to a node that was started again ------------------------------------


class _FakeStream:
    """A tritonclient client whose stream either has ended already (``stale``: a connection
    to a node that is gone) or answers ``reply``."""

    def __init__(self, stale: bool) -> None:
        self.stale, self.closed, self.callback = stale, False, None
        self._stream = None  # tritonclient's; none here

    def start_stream(self, callback) -> None:
        self.callback = callback

    def async_stream_infer(self, *args, **kwargs) -> None:
        from tritonclient.utils import InferenceServerException

        if self.stale:
            self.callback(None, InferenceServerException("Socket closed",
                                                         status="StatusCode.UNAVAILABLE"))
            raise InferenceServerException("The stream is no longer in valid state")
        self.callback(_Reply(), None)

    def stop_stream(self, cancel_requests: bool = False) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Reply:
    def as_numpy(self, name: str):
        return np.array([b"pong"], dtype=np.object_) if name == "reply" else None


def test_a_stale_pooled_connection_is_replaced_once(monkeypatch):
    from orchestrator.control import client as control

    fresh = []
    monkeypatch.setattr(control, "connect", lambda url: fresh.append(_FakeStream(False))
                        or fresh[-1])
    caller = control.ControlClient(SECRET, 5.0)
    stale = _FakeStream(True)
    caller.pool.give("node:1", stale)
    assert caller.call("node:1", "ping") == b"pong"
    assert stale.closed and len(fresh) == 1

    monkeypatch.setattr(control, "connect", lambda url: _FakeStream(True))
    caller.pool.give("node:2", _FakeStream(True))
    with pytest.raises(Exception) as raised:  # still gone on a new connection: unreachable
        caller.call("node:2", "ping")
    assert control.is_unreachable(raised.value)


def test_a_cancelled_stream_leaves_no_thread_behind():
    """tritonclient's stop_stream(cancel_requests=True) left its request iterator's thread
    waiting forever: one thread per client that left. Against a real gRPC server that
    streams until the client cancels."""
    import threading
    import time
    from concurrent import futures

    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from orchestrator.control.client import stop_stream

    class Endless(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ModelStreamInfer(self, requests, context):  # noqa: N802  (the service's name)
            next(requests)
            while context.is_active():
                yield service_pb2.ModelStreamInferResponse(
                    infer_response=service_pb2.ModelInferResponse(model_name="m"))
                time.sleep(0.01)

    def client_threads() -> int:  # the server's pool threads come and go on their own
        return sum(not t.name.startswith("server") for t in threading.enumerate())

    server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="server"))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Endless(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        before = client_threads()
        for _ in range(5):
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            answered = threading.Event()
            client.start_stream(callback=lambda result, error, done=answered: done.set())
            client.async_stream_infer("m", [tensor("x", np.zeros(1, np.int32))])
            assert answered.wait(10)
            stop_stream(client, cancel=True)
            client.close()
        deadline = time.monotonic() + 5
        while client_threads() > before:
            assert time.monotonic() < deadline, f"{client_threads() - before} threads left"
            time.sleep(0.05)
    finally:
        server.stop(0)
