"""The stage link over the KV transport: wire format, ordering, failures, and whole pipelines
whose every link is a transport link (in-process fabric and real NIXL/UCX agents)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages
from orchestrator.engine.sampling import SamplingParams
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.pipeline.link import KVProbe, Shutdown, StepMessage, TokenMessage
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.pipeline.transport_link import (
    LinkError,
    TransportReceiver,
    TransportSender,
    decode,
    encode,
)

MAX_SEQ = 64
SLOT_BYTES = 1 << 20


def test_messages_survive_the_wire_format():
    buf = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    step = StepMessage(
        microbatch=2, step=7, seq_ids=[4, 9], inputs=torch.randn(2, 8),
        prompt_seq_ids=[11], prompts=[torch.tensor([5, 6, 7])], admit=[9], release=[1, 3],
        resume={9: 12}, sampling={11: SamplingParams(temperature=0.7, top_k=5, seed=3)}, error=None,
    )
    back = decode(buf[: encode(step, buf)])
    assert isinstance(back, StepMessage)
    assert torch.equal(back.inputs, step.inputs) and torch.equal(back.prompts[0], step.prompts[0])
    assert back.prompts[0].dtype == torch.int64
    assert (back.seq_ids, back.admit, back.release, back.resume, back.sampling) == (
        step.seq_ids, step.admit, step.release, step.resume, step.sampling)
    tokens = TokenMessage(1, 3, {4: 10, 9: 0}, error="stage 1: boom")
    assert decode(buf[: encode(tokens, buf)]) == tokens
    assert isinstance(decode(buf[: encode(Shutdown(), buf)]), Shutdown)
    probe = KVProbe({4: "a", 9: "b"}, release={2: "c"}, ready={1: 77}, failed={3: "stage 1: x"},
                    waiting_at={5: 2})
    assert decode(buf[: encode(probe, buf)]) == probe
    riding = decode(buf[: encode(StepMessage(0, 1, [4], torch.tensor([3]), probe=probe), buf)])
    assert isinstance(riding, StepMessage) and riding.probe == probe
    answered = TokenMessage(0, 1, {4: 8}, probe=probe)
    assert decode(buf[: encode(answered, buf)]) == answered
    with pytest.raises(ValueError, match="does not fit a link slot"):
        encode(StepMessage(0, 0, [1], torch.zeros(1, 1 << 20)), buf)


def test_messages_arrive_in_order_through_the_ring_and_a_dead_peer_fails_the_send():
    fabric = LocalFabric()
    receiver = TransportReceiver(LocalTransport(fabric), slots=3, slot_bytes=4096)
    sender = TransportSender(LocalTransport(fabric), receiver.ticket())
    assert receiver.recv(0.01) is None
    for round_ in range(4):  # more messages than ring slots, consumed as they come
        sent = [TokenMessage(i, round_, {i: round_}) for i in range(3)]
        for message in sent:
            sender.send(message, 1.0)
        assert [receiver.recv(1.0) for _ in sent] == sent
    fabric.leave(receiver.transport.name)
    with pytest.raises(LinkError):
        sender.send(Shutdown(), 1.0)


def test_a_wake_ends_a_wait_for_messages():
    receiver = TransportReceiver(LocalTransport(LocalFabric()), slots=2, slot_bytes=4096)
    waited: list[float] = []

    def wait() -> None:
        begin = time.monotonic()
        assert receiver.recv(30.0) is None
        waited.append(time.monotonic() - begin)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    receiver.wake()
    waiter.join(5.0)
    assert waited and waited[0] < 5.0  # not its 30 s


@pytest.fixture(scope="module")
def case(tiny_model):
    model = tiny_model("gpt2")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18], [19]]
    limits = [6, 2, 9, 1, 5]
    ref = load_stages(model, 1, max_seq_len=MAX_SEQ)
    expected = [generate(ref, [p], m)[0] for p, m in zip(prompts, limits, strict=True)]
    return model, prompts, limits, expected


def test_pipeline_over_nixl_links_is_token_exact(case):
    """Every link, prompt KV and the P-side over real NIXL/UCX agents, in one process."""
    from orchestrator.kv.transport.nixl import NixlTransport

    model, prompts, limits, expected = case
    config = PipelineConfig(depth=2, batch_size=2, max_seq_len=MAX_SEQ)
    with LocalPipeline(load_stages(model, 2, max_seq_len=MAX_SEQ), config,
                       prompt_engines=load_stages(model, 1, max_seq_len=MAX_SEQ),
                       make_transport=NixlTransport) as pipeline:
        assert pipeline.generate(prompts, limits, timeout_s=60) == expected
