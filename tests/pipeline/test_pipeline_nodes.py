"""Stage nodes wired as across processes, here in one process over the local transport: the
bootstrap, admission once every stage holds the prompt KV, and its failures."""

from __future__ import annotations

import time

import pytest

from orchestrator.engine.reference import generate, load_stages
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.prefill import stream_prefill
from orchestrator.pipeline.sequence import FinishReason, Sequence

MAX_SEQ = 64
SECRET = b"nodes"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18], [19]]
LIMITS = [6, 2, 9, 1, 5]


class LocalCluster:
    """A pipeline of ``depth`` stage nodes in this process, and a P-side of ``prompt_depth``
    stages the tests drive step by step (reserve, submit, prefill)."""

    def __init__(self, model, config: PipelineConfig, prompt_depth: int = 1) -> None:
        engines = load_stages(model, config.depth, max_seq_len=config.max_seq_len)
        self.pipeline = LocalPipeline(engines, config, secret=SECRET).start()
        self.nodes, self.head = self.pipeline.nodes, self.pipeline.head
        self.prompt_engines = load_stages(model, prompt_depth, max_seq_len=MAX_SEQ)
        self.pnode = self.pipeline.transport("pnode")
        self.senders = [KVSender(self.pnode, e.kv_layout, SECRET, max_inflight=8)
                        for e in self.prompt_engines]

    def reserve(self, rid: str, prompt: list[int]) -> list[bytes]:
        return self.pipeline.reserve(rid, len(prompt))

    def prefill(self, prompts: dict[str, list[int]], tickets: dict[str, list[bytes]]):
        return stream_prefill(self.prompt_engines, self.senders, prompts, tickets)

    def close(self) -> None:
        self.pipeline.stop(timeout_s=5)
        self.pnode.close()


def holds_slot(node: StageNode, rid: str) -> bool:
    try:
        node.receiver.poll(rid)
    except KeyError:
        return False
    return True


def assert_released(nodes: list[StageNode], rid: str, timeout_s: float = 5.0) -> None:
    """The stages free a reservation when the head's next probe passes them."""
    deadline = time.monotonic() + timeout_s
    while any(holds_slot(n, rid) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [holds_slot(n, rid) for n in nodes] == [False] * len(nodes)


@pytest.fixture
def local_cluster(tiny_model):
    made: list[LocalCluster] = []

    def make(config: PipelineConfig, prompt_depth: int = 1) -> LocalCluster:
        made.append(LocalCluster(tiny_model("gpt2"), config, prompt_depth))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


@pytest.mark.parametrize(("depth", "prompt_depth", "swap"), [(1, 2, "off"), (3, 2, "on")])
def test_stage_nodes_are_token_exact(tiny_model, local_cluster, depth, prompt_depth, swap):
    ref = load_stages(tiny_model("gpt2"), 1, max_seq_len=MAX_SEQ)
    expected = [generate(ref, [p], m)[0] for p, m in zip(PROMPTS, LIMITS, strict=True)]
    c = local_cluster(PipelineConfig(depth=depth, batch_size=2, swap=swap, max_seq_len=MAX_SEQ),
                      prompt_depth)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    tickets = {rid: c.reserve(rid, p) for rid, p in zip(rids, PROMPTS, strict=True)}
    seqs = [c.head.submit_prefilled(Sequence(rid, p, m))
            for rid, p, m in zip(rids, PROMPTS, LIMITS, strict=True)]
    first = c.prefill(dict(zip(rids, PROMPTS, strict=True)), tickets)
    c.head.wait(30)
    assert [s.output_ids for s in seqs] == expected
    assert [first[r] for r in rids] == [out[0] for out in expected]
    # every receiver slot went back to its pool when its sequence was admitted
    assert not any(holds_slot(node, rid) for node in c.nodes for rid in rids)


def test_prompt_kv_problems_fail_the_request_naming_the_stage(local_cluster):
    c = local_cluster(PipelineConfig(depth=2, batch_size=2, max_seq_len=MAX_SEQ,
                                     kv_timeout_s=1.0))
    prompt = [5, 6, 7]
    tickets = {rid: c.reserve(rid, prompt) for rid in ("ok", "released", "never")}
    c.nodes[1].release_prompt("released")  # stage 1 lost its reservation
    seqs = {rid: c.head.submit_prefilled(Sequence(rid, prompt, 4)) for rid in tickets}
    # a stage passes on only the requests it holds: "released" is found missing on stage 1
    c.prefill({"ok": prompt, "released": prompt}, {r: tickets[r] for r in ("ok", "released")})
    c.head.wait(10)
    assert seqs["ok"].finish_reason is FinishReason.LENGTH and len(seqs["ok"].output_ids) == 4
    assert seqs["released"].finish_reason is FinishReason.ERROR
    assert "stage 1: prompt KV of 'released': no KV slot was reserved" in seqs["released"].error
    assert seqs["never"].error == "prompt KV of 'never' not complete on stage 0 after 1.0 s"
    assert_released(c.nodes, "never")  # by the next probe, on every stage


def test_cancel_while_waiting_for_prompt_kv_releases_it_on_every_stage(local_cluster):
    c = local_cluster(PipelineConfig(depth=2, batch_size=1, max_seq_len=MAX_SEQ))
    c.reserve("gone", [1, 2, 3])
    seq = c.head.submit_prefilled(Sequence("gone", [1, 2, 3], 5))
    assert c.head.cancel("gone") and seq.finish_reason is FinishReason.CANCELLED
    assert_released(c.nodes, "gone")


def test_miswired_nodes_are_refused(tiny_model):
    fabric = LocalFabric()
    config = PipelineConfig(depth=3, batch_size=1, max_seq_len=MAX_SEQ)
    nodes = [StageNode(tiny_model("gpt2"), i, config, secret=SECRET,
                       make_transport=lambda name: LocalTransport(fabric, name))
             for i in range(3)]
    endpoints = [n.endpoints() for n in nodes]
    with pytest.raises(ValueError, match="next endpoints are of stage 0/3, expected 2/3"):
        nodes[1].connect(endpoints[0], endpoints[0])
    with pytest.raises(ValueError, match="head endpoints are of stage 1/3, expected 0/3"):
        nodes[2].connect(endpoints[0], endpoints[1])
    with pytest.raises(RuntimeError, match="connect"):
        nodes[1].start()
    with pytest.raises(ValueError, match="stage_index 3"):
        StageNode(tiny_model("gpt2"), 3, config, secret=SECRET)
    for node in nodes:
        node.close()
