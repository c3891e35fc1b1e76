"""The control plane without servers: the secret file, request signatures, error codes."""

from __future__ import annotations

import os

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
