"""The frontend holds at most ``max_sequences`` sequences in flight: the rest wait for a seat
(not retrying reserves against the T-nodes), and a request of more is refused at once.
The T-nodes are faked out (``_generate_once``): what is tested is the frontend's gate."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from orchestrator.serving.config import NodeConfig
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.frontend import Frontend
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.node_stream import Cancelled
from orchestrator.serving.params import GenerationParams, RequestError

SEATS = 2


@pytest.fixture
def frontend():
    frontend = Frontend(["p:1"], [["h:1"]], b"secret", timeout_s=10.0, max_sequences=SEATS)
    yield frontend
    frontend.close()


def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sequences_beyond_the_seats_wait_their_turn_and_never_retry(frontend, monkeypatch):
    lock, go = threading.Lock(), threading.Event()
    counts = {"calls": 0, "running": 0, "most": 0}

    def once(prompt_ids, params, relay, is_cancelled, usage, attempt) -> None:  # a try on a T-node
        with lock:
            counts["calls"] += 1
            counts["running"] += 1
            counts["most"] = max(counts["most"], counts["running"])
        go.wait(timeout=10)
        with lock:
            counts["running"] -= 1
        relay([7], None, True)

    monkeypatch.setattr(frontend, "_generate_once", once)
    tokens: list[list[int]] = []
    threads = [threading.Thread(target=frontend.generate, args=(
        [1, 2], GenerationParams(1), lambda t, *_: tokens.append(t), lambda: False))
        for _ in range(8)]
    for thread in threads:
        thread.start()
    until(lambda: counts["running"] == SEATS)
    assert counts["calls"] == SEATS  # the other six wait for a seat, asking no T-node
    go.set()
    for thread in threads:
        thread.join(timeout=10)
    assert tokens == [[7]] * 8
    assert counts == {"calls": 8, "running": 0, "most": SEATS}


def test_a_client_that_leaves_while_waiting_for_a_seat_ends_at_once(frontend, monkeypatch):
    go, seated = threading.Event(), threading.Semaphore(0)

    def once(*args) -> None:
        seated.release()
        go.wait(timeout=10)

    monkeypatch.setattr(frontend, "_generate_once", once)
    holders = [threading.Thread(target=frontend.generate, args=(
        [1], GenerationParams(1), lambda *_: None, lambda: False)) for _ in range(SEATS)]
    for thread in holders:
        thread.start()
    for _ in range(SEATS):
        assert seated.acquire(timeout=5)
    start = time.monotonic()
    with pytest.raises(Cancelled):
        frontend.generate([1], GenerationParams(1), lambda *_: None, lambda: True)
    assert time.monotonic() - start < 1.0
    go.set()
    for thread in holders:
        thread.join(timeout=10)


def test_a_request_of_more_sequences_than_the_cluster_holds_is_refused(frontend):
    entry = EntryPoint(frontend, RequestLimits(64, 100, 1_000), Metrics(), max_requests=1)
    try:
        rows = 2
        tensors = {"input_ids": np.ones((rows, 3), np.int32),
                   "input_lengths": np.full((rows, 1), 3, np.int32),
                   "max_tokens": np.full((rows, 1), 4, np.int32)}
        assert len(entry.split(tensors)) == SEATS  # one sequence a row: fits
        tensors["num_return_sequences"] = np.full((rows, 1), 2, np.int32)
        with pytest.raises(RequestError, match=f"4 sequences .* at most {SEATS} at once"):
            entry.split(tensors)
    finally:
        entry.pool.shutdown()


def test_the_cluster_holds_each_pipelines_seats_and_prompt_slots():
    config = NodeConfig(role="frontend", model_dir="m", prefill_urls=("p:1",),
                        decode_urls=(("a:1", "a:2"), ("b:1",)), max_batch=4, num_slots=3)
    assert config.max_sequences() == (2 * 4 + 3) + (1 * 4 + 3)


def test_the_frontend_serves_a_request_for_every_sequence_its_pipelines_hold():
    """8 machines of batch 16 hold 8 x (16 + 16) sequences: a fixed pool of 64 request
    threads would leave half their batches empty."""
    machines = tuple((f"t{i}:1",) for i in range(8))
    config = NodeConfig(role="frontend", model_dir="m", decode_urls=machines, max_batch=16,
                        mode="colocated")
    assert config.concurrent_requests() == 8 * (16 + 16)
    small = replace(config, decode_urls=machines[:1])
    assert small.concurrent_requests() == 64  # never fewer than before
    assert replace(config, max_requests=8).concurrent_requests() == 8  # the deployer's cap
