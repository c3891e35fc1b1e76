"""The P- and T-node libraries in one process, with the real engine and KV connector.

The KV moves over the in-process transport here; the same code over NIXL
between real tritonservers is tested in test_cluster.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.engine.reference import generate
from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.serving.decode_service import DecodeService
from orchestrator.serving.params import GenerationParams, RequestError
from orchestrator.serving.prefill_worker import PrefillJob, PrefillWorker

SECRET = b"test-secret"
PROMPTS = [[5, 9, 33, 7], [100, 3], [42] * 9, [7, 8, 9, 10, 11, 12]]


class Client:
    """What the decode model's response sender would see for one request."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.tokens: list[int] = []
        self.error: str | None = None
        self.ticket: bytes | None = None
        self.done = threading.Event()
        self.cancel_after = cancel_after

    def emit(self, tokens: list[int], final: bool) -> None:
        self.tokens += tokens
        if final:
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.tokens) >= self.cancel_after

    def send_ticket(self, ticket: bytes) -> None:
        self.ticket = ticket

    def wait(self) -> Client:
        assert self.done.wait(30), "request never finished"
        return self


@pytest.fixture(scope="module")
def engine(tiny_model):
    return load_engine(tiny_model("llama"), max_seq_len=32)


def admit(service: DecodeService, rid: str, prompt: list[int], params, client: Client) -> None:
    service.admit(
        rid, prompt, params, client.emit, client.fail, client.is_cancelled, client.send_ticket
    )


def test_colocated_batch_matches_reference(engine):
    service = DecodeService(engine, max_batch=3)  # 4 requests: one waits for room
    try:
        clients = [Client() for _ in PROMPTS]
        for i, (prompt, client) in enumerate(zip(PROMPTS, clients, strict=True)):
            admit(service, f"r{i}", prompt, GenerationParams(max_tokens=6), client)
        got = [c.wait().tokens for c in clients]
    finally:
        service.stop()
    assert got == generate([engine], PROMPTS, max_tokens=6)


def test_disaggregated_batch_matches_reference(engine):
    fabric = LocalFabric()
    receiver = KVReceiver(LocalTransport(fabric, "t0"), engine.kv_layout, 4, SECRET, 5.0)
    sender = KVSender(LocalTransport(fabric, "p0"), engine.kv_layout, SECRET)
    prefill = PrefillWorker(engine, sender)
    service = DecodeService(engine, receiver, max_batch=4, kv_timeout_s=5.0)
    params = GenerationParams(max_tokens=6)
    try:
        clients = [Client() for _ in PROMPTS]
        for i, (prompt, client) in enumerate(zip(PROMPTS, clients, strict=True)):
            admit(service, f"r{i}", prompt, params, client)
        jobs = [
            PrefillJob(f"r{i}", prompt, params, client.ticket)
            for i, (prompt, client) in enumerate(zip(PROMPTS, clients, strict=True))
        ]
        firsts = prefill.run(jobs)
        got = [[first, *c.wait().tokens] for first, c in zip(firsts, clients, strict=True)]
    finally:
        service.stop()
    assert got == generate([engine], PROMPTS, max_tokens=6)
    for i in range(4):  # every slot came back
        receiver.reserve(f"again{i}", 3)


def test_end_id_cancel_and_refusal(engine):
    reference = generate([engine], PROMPTS[:1], max_tokens=8)[0]
    service = DecodeService(engine)
    try:
        stop_at = Client()
        admit(service, "eos", PROMPTS[0], GenerationParams(8, end_id=reference[2]), stop_at)
        cancelled = Client(cancel_after=2)
        admit(service, "cancel", PROMPTS[0], GenerationParams(max_tokens=20), cancelled)
        assert stop_at.wait().tokens == reference[: reference.index(reference[2]) + 1]
        # Triton closes a cancelled stream itself: the loop just drops the request.
        deadline = time.monotonic() + 10
        while service.worker.queue_length:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert cancelled.tokens == reference[:2] and cancelled.error is None
        with pytest.raises(RequestError, match="exceeds the context"):
            admit(service, "long", [1] * 30, GenerationParams(max_tokens=8), Client())
        after = Client()
        admit(service, "after", PROMPTS[0], GenerationParams(max_tokens=8), after)
        assert after.wait().tokens == reference
    finally:
        service.stop()


def test_kv_that_never_comes_fails_the_request_and_frees_the_slot(engine):
    receiver = KVReceiver(LocalTransport(LocalFabric(), "t0"), engine.kv_layout, 1, SECRET, 0.3)
    service = DecodeService(engine, receiver, kv_timeout_s=0.3)
    try:
        orphan = Client()
        admit(service, "orphan", PROMPTS[0], GenerationParams(max_tokens=4), orphan)
        assert "KV transfer failed" in orphan.wait().error
    finally:
        service.stop()
    with pytest.raises(KeyError, match="holds no slot"):  # released
        receiver.poll("orphan")
