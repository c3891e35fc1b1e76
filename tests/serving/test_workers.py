"""The P- and T-node libraries in one process, with the real engine, pipeline and KV connector.

The KV moves over the in-process transport here; the same code over NIXL
between real tritonservers is tested in test_cluster.py and test_pipeline_cluster.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from orchestrator.engine.reference import generate, log_softmax_along
from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.prefill import PrefillCancelled
from orchestrator.serving import prefill_worker
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams, RequestError
from orchestrator.serving.prefill_worker import PrefillJob, PrefillWorker
from orchestrator.serving.token_service import ControlRequest, TokenService

SECRET = b"test-secret"
MAX_SEQ = 32
PROMPTS = [[5, 9, 33, 7], [100, 3], [42] * 9, [7, 8, 9, 10, 11, 12]]


class Client:
    """What the decode model's response sender would see for one request."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.tokens: list[int] = []
        self.log_probs: list = []
        self.error: str | None = None
        self.ticket: bytes | None = None
        self.done = threading.Event()
        self.cancel_after = cancel_after
        self.cancel: Callable[[], None] = lambda: None  # what Triton's cancellation does

    def emit(self, tokens: list[int], log_probs, final: bool) -> None:
        self.tokens += tokens
        if log_probs is not None:
            self.log_probs += log_probs
        if self.cancel_after is not None and len(self.tokens) >= self.cancel_after:
            self.cancel_after = None
            self.cancel()  # the client leaves mid-stream
        if final:
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    def send_ticket(self, ticket: bytes) -> None:
        self.ticket = ticket

    def replies(self) -> tuple:
        """``TokenService.admit``'s callbacks for this client."""
        return self.emit, self.fail, self.send_ticket

    def wait(self) -> Client:
        assert self.done.wait(30), "request never finished"
        return self


@pytest.fixture(scope="module")
def engine(model):
    return load_engine(model, max_seq_len=MAX_SEQ)


def colocated(engine, batch: int) -> TokenService:
    config = PipelineConfig(depth=1, batch_size=batch, mode="colocated")
    node = StageNode(None, 0, config, secret=b"", engine=engine).start()
    return TokenService(engine, node=node)


def admit(service: TokenService, rid: str, prompt: list[int], params, client: Client) -> None:
    client.cancel = lambda: service.cancel(rid)
    service.admit(rid, prompt, params, client.emit, client.fail, client.send_ticket)


def test_colocated_batch_matches_reference(engine):
    service = colocated(engine, 3)  # 4 requests: one waits for room
    try:
        clients = [Client() for _ in PROMPTS]
        for i, (prompt, client) in enumerate(zip(PROMPTS, clients, strict=True)):
            admit(service, f"r{i}", prompt, GenerationParams(max_tokens=6), client)
        got = [c.wait().tokens for c in clients]
        steps = json.loads(service.control("steps", ControlRequest()))
    finally:
        service.stop()
    assert got == generate([engine], PROMPTS, max_tokens=6)
    # Every token after a prompt's first came from a step that decoded it.
    decoding = sum(s["count"] for kind, s in steps.items() if "decode" in kind)
    assert 5 <= decoding <= 5 * len(PROMPTS)
    assert all(s["median_ms"] > 0 for s in steps.values())


def test_colocated_log_probs_are_the_reference_log_softmax(engine):
    service = colocated(engine, 2)
    try:
        asked, plain = Client(), Client()
        admit(service, "lp", PROMPTS[0], GenerationParams(max_tokens=6, return_log_probs=True,
                                                          top_log_probs=2), asked)
        admit(service, "plain", PROMPTS[0], GenerationParams(max_tokens=6), plain)
        asked.wait(), plain.wait()
    finally:
        service.stop()
    rows = log_softmax_along([engine], PROMPTS[0], asked.tokens)
    assert asked.tokens == plain.tokens and plain.log_probs == []
    assert [p.log_prob for p in asked.log_probs] == pytest.approx(
        rows[range(6), asked.tokens].tolist(), abs=1e-5)
    assert [[i for i, _ in p.top] for p in asked.log_probs] == rows.topk(2).indices.tolist()


def disaggregated(model, engine, max_inflight: int = 4, metrics: Metrics | None = None,
                  prompt_slots: int = 16) -> tuple[TokenService, PrefillWorker]:
    """A one-stage T-node (two sequences at a time) and a P-node's prefill worker that
    streams it the KV over the in-process transport."""
    fabric = LocalFabric()
    config = PipelineConfig(depth=1, batch_size=2, max_seq_len=MAX_SEQ, kv_timeout_s=5,
                            prompt_slots=prompt_slots)
    node = StageNode(model, 0, config, secret=SECRET,
                     make_transport=lambda name: LocalTransport(fabric, name)).start()
    sender = KVSender(LocalTransport(fabric, "p0"), engine.kv_layout, SECRET,
                      max_inflight=max_inflight)
    return TokenService(node.engine, node=node), PrefillWorker([engine], [sender],
                                                               metrics=metrics)


def test_disaggregated_batch_matches_reference(model, engine):
    service, prefill = disaggregated(model, engine)
    limits = [6, 2, 1, 5]  # more requests than slots, early stops: slots refill mid-run
    try:
        clients = [Client() for _ in PROMPTS]
        for i, (prompt, client, n) in enumerate(zip(PROMPTS, clients, limits, strict=True)):
            admit(service, f"r{i}", prompt, GenerationParams(max_tokens=n), client)
        jobs = [
            PrefillJob(f"r{i}", prompt, GenerationParams(max_tokens=n), [client.ticket])
            for i, (prompt, client, n) in enumerate(zip(PROMPTS, clients, limits, strict=True))
        ]
        firsts = prefill.run(jobs)
        got = [[first, *c.wait().tokens] for (first, *_), c in zip(firsts, clients, strict=True)]
        assert not service.clients  # every request forgotten
    finally:
        service.stop()
    assert got == [generate([engine], [p], n)[0] for p, n in zip(PROMPTS, limits, strict=True)]


def test_end_id_cancel_and_refusal(engine, monkeypatch):
    reference = generate([engine], PROMPTS[:1], max_tokens=8)[0]
    decode = engine.decode

    def slow_decode(*args):  # 28 steps outlast the cancellation on any machine
        time.sleep(0.02)
        return decode(*args)

    monkeypatch.setattr(engine, "decode", slow_decode)
    service = colocated(engine, 4)
    try:
        stop_at = Client()
        admit(service, "eos", PROMPTS[0], GenerationParams(8, end_id=reference[2]), stop_at)
        cancelled = Client(cancel_after=2)
        admit(service, "cancel", PROMPTS[0], GenerationParams(max_tokens=28), cancelled)
        assert stop_at.wait().tokens == reference[: reference.index(reference[2]) + 1]
        # Triton closes a cancelled stream itself: the pipeline just drops the request.
        deadline = time.monotonic() + 10
        while service.clients:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert 2 <= len(cancelled.tokens) < 28 and cancelled.error is None
        assert cancelled.tokens == generate([engine], PROMPTS[:1], 28)[0][: len(cancelled.tokens)]
        with pytest.raises(RequestError, match="exceeds the context"):
            admit(service, "long", [1] * 30, GenerationParams(max_tokens=8), Client())
        with pytest.raises(RequestError, match="a colocated node takes no prompt KV"):
            service.control("reserve", ControlRequest("x", 3))
        after = Client()
        admit(service, "after", PROMPTS[0], GenerationParams(max_tokens=8), after)
        assert after.wait().tokens == reference
    finally:
        service.stop()


def test_a_request_ended_by_the_end_op_closes_its_stream_with_a_final_response(
        engine, monkeypatch):
    """The frontend's client left: ``end`` stops the request on the node, which answers its
    stream's last response itself (no gRPC cancellation needed); the slot is free again."""
    decode = engine.decode

    def slow_decode(*args):  # 28 steps outlast the test's call on any machine
        time.sleep(0.02)
        return decode(*args)

    monkeypatch.setattr(engine, "decode", slow_decode)
    outcomes = Outcomes()
    config = PipelineConfig(depth=1, batch_size=1, mode="colocated")
    service = TokenService(engine, node=StageNode(None, 0, config, secret=b"", engine=engine
                                                  ).start(), metrics=outcomes)
    try:
        left = Client()
        admit(service, "left", PROMPTS[0], GenerationParams(max_tokens=28), left)
        deadline = time.monotonic() + 10
        while len(left.tokens) < 2:
            assert time.monotonic() < deadline, "no tokens came"
            time.sleep(0.005)
        assert service.control("end", ControlRequest("left")) == b"1"
        assert left.wait().error is None and 2 <= len(left.tokens) < 28  # a final response
        assert outcomes.outcomes == ["cancelled"] and not service.clients
        assert service.control("end", ControlRequest("left")) == b"0"  # ended already
        after = Client()  # the one slot is free
        admit(service, "after", PROMPTS[0], GenerationParams(max_tokens=3), after)
        assert after.wait().tokens == generate([engine], PROMPTS[:1], 3)[0]
    finally:
        service.stop()


class Feed:
    """What a token feed's listener (its rows) and its request's stream (its final response)
    would see."""

    def __init__(self) -> None:
        self.responses: list[list] = []  # each message's rows
        self.closed = threading.Event()  # the feed request's final response went out
        self.sink_closed = False
        self.cancelled = False

    def send(self, rows: list) -> None:
        self.responses.append(rows)

    def close(self) -> None:
        self.sink_closed = True

    def tokens(self, request_id: str) -> tuple[list[int], bool]:
        rows = [r for response in self.responses for r in response if r[0] == request_id]
        return [t for r in rows for t in r[1]], any(r[3] for r in rows)


def open_feed(service: TokenService, feed: Feed, name: str = "feed") -> None:
    service.open_feed(name, feed, feed.closed.set)


def test_a_token_feed_carries_every_requests_tokens_in_one_response_per_step(engine):
    """Requests naming a feed get their tokens there, several requests in one response;
    their own streams get an empty last response once the feed said they are done."""
    service = colocated(engine, 3)
    feed = Feed()
    try:
        open_feed(service, feed)
        with pytest.raises(RequestError, match="no token feed 'other'"):
            service.admit("x", PROMPTS[0], GenerationParams(max_tokens=6), *Client().replies(),
                          feed="other")
        clients = [Client() for _ in PROMPTS[:3]]
        for i, (prompt, client) in enumerate(zip(PROMPTS, clients, strict=False)):
            service.admit(f"r{i}", prompt, GenerationParams(max_tokens=6), *client.replies(),
                          feed="feed")
        for client in clients:
            client.wait()
        assert all(c.tokens == [] and c.error is None for c in clients)  # all went to the feed
        got = [feed.tokens(f"r{i}") for i in range(3)]
        assert [tokens for tokens, _ in got] == generate([engine], PROMPTS[:3], max_tokens=6)
        assert all(done for _, done in got)
        assert max(len(rows) for rows in feed.responses) > 1  # one response, several requests
        assert service.control("end", ControlRequest("feed")) == b"1"
        assert feed.closed.wait(5)
    finally:
        service.stop()


def test_a_cancelled_feed_is_closed_and_the_node_stop_closes_the_others(engine):
    service = colocated(engine, 1)
    gone, open_ = Feed(), Feed()
    try:
        open_feed(service, gone, "gone")
        open_feed(service, open_, "open")
        refused = Feed()
        with pytest.raises(RequestError, match="already open"):
            open_feed(service, refused, "open")
        assert refused.sink_closed  # its socket is not left open
        service.cancel("gone")  # Triton cancelled it: its frontend went away
        assert gone.closed.wait(5) and gone.sink_closed and not open_.closed.is_set()
    finally:
        service.stop()
    assert open_.closed.is_set() and open_.sink_closed  # final response out: Triton frees it


def test_kv_that_never_comes_fails_the_request_and_frees_the_slot(model):
    config = PipelineConfig(depth=1, batch_size=1, max_seq_len=MAX_SEQ, kv_timeout_s=0.3)
    fabric = LocalFabric()
    node = StageNode(model, 0, config, secret=SECRET,
                     make_transport=lambda name: LocalTransport(fabric, name)).start()
    service = TokenService(node.engine, node=node)
    try:
        with pytest.raises(RequestError, match="unknown op 'nope'"):
            service.control("nope", ControlRequest())
        orphan = Client()
        admit(service, "orphan", PROMPTS[0], GenerationParams(max_tokens=4), orphan)
        assert "stage 0" in orphan.wait().error
        deadline = time.monotonic() + 5
        while True:  # the head's next probe releases the slot on every stage
            try:
                node.receiver.poll("orphan")
            except KeyError:
                break
            assert time.monotonic() < deadline, "the orphan's KV slot was never released"
            time.sleep(0.02)
    finally:
        service.stop()


def test_a_failing_prefill_gives_its_staging_block_back(model, engine, monkeypatch):
    """A step that fails after the KV transfer started (the first token's sampling, here
    made to fail) leaves no staging block taken: before, 16 such requests took them all."""
    from orchestrator.pipeline import prefill as prefill_module

    service, prefill = disaggregated(model, engine, max_inflight=2)
    try:
        for i in range(3):  # more failures than staging blocks
            client = Client()
            admit(service, f"bad{i}", PROMPTS[0], GenerationParams(max_tokens=4), client)
            with monkeypatch.context() as patch:
                patch.setattr(prefill_module.Sampler, "pick", lambda self, logits: 1 / 0)
                (result,) = prefill.run([PrefillJob(f"bad{i}", PROMPTS[0],
                                                    GenerationParams(max_tokens=4),
                                                    [client.ticket])])
            assert isinstance(result, ZeroDivisionError)
            service.head.cancel(f"bad{i}")
        deadline = time.monotonic() + 5
        while prefill.staging_in_flight():
            assert time.monotonic() < deadline, "a failed prefill kept its staging block"
            time.sleep(0.02)
        good = Client()
        admit(service, "good", PROMPTS[1], GenerationParams(max_tokens=3), good)
        ((first, *_),) = prefill.run([PrefillJob("good", PROMPTS[1],
                                                GenerationParams(max_tokens=3), [good.ticket])])
        assert [first, *good.wait().tokens] == generate([engine], PROMPTS[1:2], 3)[0]
    finally:
        service.stop()


class Outcomes(Metrics):
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def request_done(self, outcome: str) -> None:
        self.outcomes.append(outcome)


def test_a_prefill_whose_client_left_stops_and_gives_everything_back(model, engine,
                                                                     monkeypatch):
    """A job whose client leaves mid-prefill stops after the layer in progress (here the
    second of four), takes no staging block with it, and is counted cancelled; one that
    left before it started never runs. The next prompt's tokens are the reference's."""
    monkeypatch.setattr(prefill_worker, "CANCEL_POLL_S", 0.0)  # ask after every layer
    metrics = Outcomes()
    service, prefill = disaggregated(model, engine, max_inflight=2, metrics=metrics,
                                     prompt_slots=2)
    answers = [False, False, True]  # before it starts, after layer 0, after layer 1
    try:
        gone = Client()
        admit(service, "gone", PROMPTS[0], GenerationParams(max_tokens=4), gone)
        (result,) = prefill.run([PrefillJob("gone", PROMPTS[0], GenerationParams(max_tokens=4),
                                            [gone.ticket], lambda: answers.pop(0))])
        assert isinstance(result, PrefillCancelled) and not answers  # asked 3 times of 5
        assert prefill.staging_in_flight() == 0
        (result,) = prefill.run([PrefillJob("early", PROMPTS[0], GenerationParams(max_tokens=4),
                                            [b"never used"], lambda: True)])
        assert isinstance(result, PrefillCancelled)
        assert metrics.outcomes == ["cancelled", "cancelled"]
        service.head.cancel("gone")  # what the frontend's cancelled stream does
        deadline = time.monotonic() + 5
        while service.node.receiver.held():
            assert time.monotonic() < deadline, "the cancelled request kept its KV slot"
            time.sleep(0.01)
        # Both prompt slots take a request at once: the P-node said it writes nothing more into
        # the cancelled one's (without that, it waits out kv_timeout_s for a late write).
        goods = [Client(), Client()]
        for i, good in enumerate(goods):
            admit(service, f"good{i}", PROMPTS[1], GenerationParams(max_tokens=3), good)
        firsts = prefill.run([PrefillJob(f"good{i}", PROMPTS[1], GenerationParams(max_tokens=3),
                                         [good.ticket]) for i, good in enumerate(goods)])
        for (first, *_), good in zip(firsts, goods, strict=True):
            assert [first, *good.wait().tokens] == generate([engine], PROMPTS[1:2], 3)[0]
        assert metrics.outcomes[-2:] == ["finished", "finished"]
    finally:
        service.stop()
