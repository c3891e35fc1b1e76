"""The control plane without Triton: the secret file, request signatures, error codes, and the
gRPC client's streams (pooled, cancelled)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from orchestrator.control.auth import (
    ENV,
    WINDOW_S,
    Unauthenticated,
    Verifier,
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
    with pytest.raises(Unauthenticated, match="stale"):  # seconds, not minutes
        verify(SECRET, signature, "decode", "reserve", "r1", now=1000 + WINDOW_S + 1)
    assert WINDOW_S <= 30
    for missing in (None, ""):
        with pytest.raises(Unauthenticated, match="unsigned"):
            verify(SECRET, missing, "x")
    for malformed in ("nonsense", "1:00", "x:y:z"):
        with pytest.raises(Unauthenticated, match="malformed"):
            verify(SECRET, malformed, "x")
    assert sign(SECRET, "x", now=1000) != sign(SECRET, "x", now=1000)  # a nonce each


def _generate(prompt: list[int], max_tokens: int = 8) -> dict[str, np.ndarray]:
    return {"input_ids": np.array(prompt, dtype=np.int32),
            "params": np.array([f'{{"max_tokens": {max_tokens}}}'.encode()], dtype=np.object_),
            "kv_ticket": np.array([b"ticket-a", b"ticket-b"], dtype=np.object_)}


def test_a_request_signature_covers_every_input_the_target_and_is_good_once():
    """An attacker who captured a signed request replays it, swaps its body (prompt,
    parameters, ticket), sends it to another node, or to the node started again: all
    refused."""
    import json

    node, arrays = "127.0.0.1:9001", _generate([1, 2, 3])
    parameters = json.dumps(request_parameters(SECRET, "prefill", "prefill", "r7", node, arrays))
    receiver = Verifier(SECRET, node)
    receiver.check_request(parameters, "prefill", "prefill", "r7", arrays)
    with pytest.raises(Unauthenticated, match="replayed"):
        receiver.check_request(parameters, "prefill", "prefill", "r7", arrays)
    swapped = [_generate([1, 2, 4]), _generate([1, 2, 3], max_tokens=9),
               {**arrays, "kv_ticket": arrays["kv_ticket"][::-1].copy()},
               {**arrays, "input_ids": arrays["input_ids"].reshape(1, 3)},
               {**arrays, "input_ids": arrays["input_ids"].astype(np.int64)},
               {k: v for k, v in arrays.items() if k != "kv_ticket"},
               {**arrays, "peers": np.array([b"127.0.0.1:1"], dtype=np.object_)}]
    for body in swapped:
        with pytest.raises(Unauthenticated, match="bad request signature"):
            Verifier(SECRET, node).check_request(parameters, "prefill", "prefill", "r7", body)
    for model, op, request_id, target in [("decode", "prefill", "r7", node),
                                          ("prefill", "reserve", "r7", node),
                                          ("prefill", "prefill", "r8", node),
                                          ("prefill", "prefill", "r7", "127.0.0.1:9002")]:
        with pytest.raises(Unauthenticated, match="bad request signature"):
            Verifier(SECRET, target).check_request(parameters, model, op, request_id, arrays)
    for bad in ("", "{}", "[1]", '{"auth": 3}', "not json"):
        with pytest.raises(Unauthenticated):
            Verifier(SECRET, node).check_request(bad, "prefill", "prefill", "r7", arrays)
    # The node started again (its replay cache empty) refuses what was signed before.
    restarted = Verifier(SECRET, node, clock=lambda: time.time() + 5)
    with pytest.raises(Unauthenticated, match="before this receiver started"):
        restarted.check_request(parameters, "prefill", "prefill", "r7", arrays)


def test_the_replay_cache_forgets_after_the_window_and_stays_bounded():
    now = [1000.0]
    receiver = Verifier(SECRET, window_s=5.0, capacity=3, clock=lambda: now[0])
    signatures = [sign(SECRET, "x", now=now[0]) for _ in range(4)]
    for signature in signatures[:3]:
        receiver.verify(signature, "x")
    with pytest.raises(Unauthenticated, match="too many"):  # full of live nonces: refused
        receiver.verify(signatures[3], "x")
    now[0] += 6.0  # every nonce expired with its signature
    receiver.verify(sign(SECRET, "x", now=now[0]), "x")
    assert len(receiver._seen) == 1
    with pytest.raises(Unauthenticated, match="stale"):
        receiver.verify(signatures[0], "x")


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
