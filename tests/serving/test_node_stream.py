"""A request on the frontend's stream to a T-node: its own responses and its feed's tokens,
in either order (the real stream to real tritonservers: test_cluster.py and the others)."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from orchestrator.control.errors import ControlError, ErrorCode
from orchestrator.serving.node_stream import Cancelled, RequestStream, StreamTimeout, _Tokens


class Result:
    """An InferResult as tritonclient hands it over: outputs and the final flag."""

    def __init__(self, final: bool, **outputs: np.ndarray) -> None:
        self.outputs = outputs
        flag = SimpleNamespace(bool_param=final)
        self.response = SimpleNamespace(id="r", parameters={"triton_final_response": flag})

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)

    def get_response(self) -> SimpleNamespace:
        return self.response


def stream(*items: object, timeout_s: float = 5.0) -> RequestStream:
    responses: queue.Queue = queue.Queue()
    for item in items:
        responses.put(item)
    node = SimpleNamespace(url="t:1", heard_at=time.monotonic())
    return RequestStream(node, "r", responses, timeout_s)


def never_cancelled() -> bool:
    return False


def test_the_last_tokens_go_out_with_the_final_flag_in_either_order():
    for last_two in ([_Tokens([3], None, True), Result(True)],
                     [Result(True), _Tokens([3], None, True)]):
        request = stream(_Tokens([1, 2], None, False))
        assert request.tokens(never_cancelled) == ([1, 2], None, False)  # nothing more yet
        for item in last_two:
            request.responses.put(item)
        assert request.tokens(never_cancelled) == ([3], None, True)


def test_the_feed_done_waits_for_the_final_response_behind_it():
    request = stream(_Tokens([1], None, True))
    request.responses.put(Result(True))
    assert request.tokens(never_cancelled) == ([1], None, True)  # one response, final


def test_tokens_already_queued_go_out_together_and_the_ticket_is_kept_apart():
    ticket = Result(False, kv_ticket=np.array([b"t"], dtype=np.object_))
    request = stream(_Tokens([1], None, False), ticket, _Tokens([2], None, False),
                     _Tokens([3], None, True), Result(True))
    assert request.next(never_cancelled) is ticket  # a feed's tokens that came first wait
    assert request.tokens(never_cancelled) == ([1, 2, 3], None, True)


def test_a_failure_a_lost_stream_a_silent_node_and_a_client_that_left():
    failure = Result(True, error_code=np.array([int(ErrorCode.PIPELINE_LOST)], np.int32),
                     error=np.array([b"stage 1 lost"], dtype=np.object_))
    with pytest.raises(ControlError, match="stage 1 lost") as failed:
        stream(_Tokens([1], None, False), failure).tokens(never_cancelled)
    assert failed.value.code is ErrorCode.PIPELINE_LOST
    with pytest.raises(ConnectionError, match="gone"):
        stream(ConnectionError("gone")).tokens(never_cancelled)
    with pytest.raises(StreamTimeout, match="sent nothing"):
        stream(timeout_s=0.1).tokens(never_cancelled)
    with pytest.raises(Cancelled):
        stream(timeout_s=5.0).tokens(lambda: True)


def test_a_request_queued_behind_a_running_batch_waits_while_its_node_steps():
    """Silence on a request alone is not a lost node: its node's other traffic (a full
    batch's steps) keeps it waiting past its own timeout."""
    request = stream(timeout_s=0.1)
    stop = threading.Event()

    def node_steps_then_admits() -> None:
        until = time.monotonic() + 0.4  # four of the request's timeouts
        while time.monotonic() < until and not stop.wait(0.02):
            request.node.heard_at = time.monotonic()
        request.responses.put(_Tokens([7], None, True))
        request.responses.put(Result(True))

    stepping = threading.Thread(target=node_steps_then_admits)
    stepping.start()
    try:
        assert request.tokens(never_cancelled) == ([7], None, True)
    finally:
        stop.set()
        stepping.join(5)


def node_with(*request_ids: str):
    """A NodeStream's delivery side alone (no Triton): its queues, forwards and lock."""
    from orchestrator.serving.node_stream import NodeStream

    node = NodeStream.__new__(NodeStream)
    node.url, node.heard_at, node._lock = "t:1", time.monotonic(), threading.Lock()
    node._queues = {rid: queue.SimpleQueue() for rid in request_ids}
    node._forwards = {}
    return node


def test_a_streaming_request_gets_its_tokens_on_the_feeds_thread_and_its_last_on_its_own():
    node = node_with("r", "other")
    request = RequestStream(node, "r", node._queues["r"], 5.0)
    node._deliver([("r", [1], None, False), ("other", [9], None, False)])
    relayed: list[list[int]] = []
    request.forward(lambda tokens, log_probs: relayed.append(tokens))
    assert relayed == [[1]]  # what came before, first
    node._deliver([("r", [2, 3], None, False), ("other", [8], None, False)])
    assert relayed == [[1], [2, 3]]  # handed on as it came, on the listener's thread
    node._deliver([("r", [4], None, True)])
    node._queues["r"].put(Result(True))
    assert request.tokens(never_cancelled) == ([4], None, True)  # the last, with the final
    assert relayed == [[1], [2, 3]]
    other = RequestStream(node, "other", node._queues["other"], 5.0)
    node._queues["other"].put(Result(True))
    node._deliver([("other", [7], None, True)])
    assert other.tokens(never_cancelled) == ([9, 8, 7], None, True)  # not forwarded: queued


def test_a_relay_that_fails_ends_the_request_and_a_stopped_one_gets_nothing_more():
    node = node_with("r")
    request = RequestStream(node, "r", node._queues["r"], 5.0)
    calls: list[list[int]] = []

    def failing(tokens, log_probs) -> None:
        calls.append(tokens)
        raise RuntimeError("the client's stream is closed")

    request.forward(failing)
    node._deliver([("r", [1], None, False)])
    node._deliver([("r", [2], None, False)])
    assert calls == [[1]]
    with pytest.raises(RuntimeError, match="closed"):
        request.tokens(never_cancelled)
    node = node_with("r")
    request = RequestStream(node, "r", node._queues["r"], 5.0)
    relayed: list[list[int]] = []
    request.forward(lambda tokens, log_probs: relayed.append(tokens))
    request.stop_forwarding()
    node._deliver([("r", [5], None, False)])
    assert relayed == [] and node._queues["r"].get_nowait().ids == [5]
