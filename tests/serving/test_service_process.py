"""A T-node's token service in its own process, driven as its Triton stub drives it: a real
process over a real socket pair (no tritonserver: the cluster tests serve through it)."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.control.auth import ENV
from orchestrator.control.errors import ControlError, ErrorCode
from orchestrator.engine.reference import generate, load_stages
from orchestrator.serving.config import Mode, NodeConfig, Role
from orchestrator.serving.metrics import PublishedMetrics, Series
from orchestrator.serving.params import GenerationParams
from orchestrator.serving.service_process import ServiceProcess
from orchestrator.serving.token_service import ControlRequest

PROMPT = [5, 9, 2, 7, 11]


class Recorded(PublishedMetrics):
    def __init__(self) -> None:
        self.counted: dict[Series, float] = {}
        super().__init__()

    def publish(self, added: dict[Series, float], gauges: dict[Series, float]) -> None:
        for series, amount in added.items():
            self.counted[series] = self.counted.get(series, 0) + amount


class Stream:
    """One request's answers, as its Triton response sender would get them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.failed: str | None = None
        self.done = threading.Event()
        self.cancelled = False

    def emit(self, tokens, log_probs, final) -> None:
        self.tokens += tokens
        if final:
            self.done.set()

    def fail(self, message: str) -> None:
        self.failed = message
        self.done.set()

    def admit(self, service: ServiceProcess, request_id: str, max_tokens: int) -> Stream:
        service.admit(request_id, PROMPT, GenerationParams(max_tokens=max_tokens), self.emit,
                      self.fail, lambda: self.cancelled, lambda ticket: None)
        return self


@pytest.fixture
def service(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV, "ab" * 32)
    model = tiny_model("llama")
    config = NodeConfig(role=Role.DECODE, model_dir=str(model), mode=Mode.COLOCATED,
                        name="t0", max_batch=4)
    service = ServiceProcess(config.to_json(), Recorded())
    yield service, model
    service.stop()


def wait_until(what: str, condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {timeout_s} s")
        time.sleep(0.02)


def test_tokens_through_the_relay_match_the_reference(service):
    service, model = service
    stream = Stream().admit(service, "r1", 12)
    assert stream.done.wait(30), "no last answer"
    assert stream.failed is None
    assert stream.tokens == generate(load_stages(model, 1), [PROMPT], 12)[0]
    wait_until("finished count", lambda: service.metrics.counted.get(("requests", "finished")))
    assert service.control("held", ControlRequest()) == b'{"clients": 0, "kv": 0}'


def test_a_refused_request_and_an_unknown_op_raise_with_their_codes(service):
    service, _ = service
    with pytest.raises(ControlError) as refused:
        Stream().admit(service, "r1", 100_000)  # more than the model's positions
    assert refused.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ControlError, match="unknown op 'nope'"):
        service.control("nope", ControlRequest())
    assert Stream().admit(service, "r1", 4).done.wait(30)  # the id was not kept


def test_a_cancelled_request_ends_on_the_node(service):
    service, _ = service
    stream = Stream().admit(service, "r1", 100)
    wait_until("first token", lambda: stream.tokens)
    stream.cancelled = True  # as Triton says once the client left
    wait_until("the node to let it go",
               lambda: service.control("held", ControlRequest()) == b'{"clients": 0, "kv": 0}')
    assert len(stream.tokens) < 100


def test_a_lost_service_fails_what_it_held_and_every_later_call(service):
    service, _ = service
    stream = Stream().admit(service, "r1", 200)
    wait_until("first token", lambda: stream.tokens)
    service.process.kill()
    assert stream.done.wait(10)
    assert "token service exited" in stream.failed
    with pytest.raises(ControlError) as lost:
        service.control("held", ControlRequest())
    assert lost.value.code is ErrorCode.PIPELINE_LOST
