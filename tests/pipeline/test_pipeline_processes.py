"""Token pipelines across real processes: stages in spawned processes linked by NIXL (loopback),
prompts prefilled in another process with a different depth, KV streamed to every stage.

The test process plays node 0 (the head and stage 0) and the coordinator that carries
endpoints and tickets between processes.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import asdict

import pytest
import torch
from spawned import Child
from stage_procs import SECRET, prompt_node, stage_node

from orchestrator.engine.reference import generate, load_stages
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.sequence import FinishReason, Sequence

pytestmark = pytest.mark.slow  # stages and a P-node in spawned processes
MAX_SEQ = 64
# More requests than slots, different limits: early stops (length and eos) and refills.
LIMITS = [3, 9, 1, 12, 5, 7, 2, 8]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gpt2")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 20, (len(LIMITS),), generator=g).tolist()
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def expected(model, prompts):
    """Reference outputs with an eos the reference emits mid-way through a long output."""
    engines = load_stages(model, 1, max_seq_len=MAX_SEQ)
    eos_id = generate(engines, [prompts[3]], LIMITS[3])[0][4]
    outputs = [generate(engines, [p], m, eos_id)[0] for p, m in zip(prompts, LIMITS, strict=True)]
    assert any(out[-1] == eos_id and len(out) < m for out, m in zip(outputs, LIMITS, strict=True))
    return eos_id, outputs


class Cluster:
    """Node 0 here; stages 1..D-1 and a P-node in spawned processes."""

    def __init__(self, model, config: PipelineConfig, prompt_depth: int, made: list) -> None:
        made.append(self)  # before anything can fail: a half-built cluster is torn down too
        self.config, self.stages, self.pnodes = config, [], []
        self.node0: StageNode | None = None
        self.stages = [Child(stage_node, model, i, asdict(config)) for i in range(1, config.depth)]
        self.pnodes = [Child(prompt_node, model, prompt_depth, MAX_SEQ)] if prompt_depth else []
        self.node0 = StageNode(model, 0, config, secret=SECRET)
        endpoints = [self.node0.endpoints()] + [c.answer() for c in self.stages]
        for pnode in self.pnodes:
            pnode.answer()
        for i, child in enumerate(self.stages, start=1):
            child.call("connect", endpoints[(i + 1) % config.depth], endpoints[0])
        self.node0.connect(endpoints[1], endpoints[0])
        for child in self.stages:  # remote stages first: node 0's head starts counting beats
            child.call("start")
        self.head = self.node0.start().head

    def submit(self, requests: dict[str, tuple[list[int], int]], eos_id: int | None,
               on_token=None) -> tuple[list[Sequence], dict[str, int]]:
        """Reserve a slot on every stage, submit to the head at once, then prefill (in
        batches, so later requests arrive while earlier ones decode). Returns the sequences
        and the first tokens the P-node sampled."""
        tickets = {
            rid: [self.node0.reserve_prompt(rid, len(p))]
            + [c.call("reserve", rid, len(p)) for c in self.stages]
            for rid, (p, _) in requests.items()
        }
        seqs = [self.head.submit_prefilled(Sequence(rid, p, m, eos_id, on_token=on_token))
                for rid, (p, m) in requests.items()]
        rids, first = list(requests), {}
        for batch in (rids[i : i + 3] for i in range(0, len(rids), 3)):
            first |= self.pnodes[0].call("prefill", {r: requests[r][0] for r in batch},
                                         {r: tickets[r] for r in batch})
        return seqs, first

    def kv_held(self) -> list[int]:
        return [len(self.node0.kv)] + [c.call("held") for c in self.stages]

    def assert_kv_freed(self, timeout_s: float = 5.0) -> None:
        """Ended sequences' KV goes with their microbatch's next step, just after."""
        deadline = time.monotonic() + timeout_s
        while any(held := self.kv_held()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == [0] * self.config.depth

    def close(self) -> None:
        if self.node0 is not None:
            self.node0.close(timeout_s=5)
        for child in [*self.stages, *self.pnodes]:
            child.close()


@pytest.fixture
def cluster(model):
    made: list[Cluster] = []

    def make(config: PipelineConfig, prompt_depth: int) -> Cluster:
        return Cluster(model, config, prompt_depth, made)

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize(("depth", "prompt_depth", "swap"), [(2, 1, "on"), (3, 2, "off")])
def test_multiprocess_pipeline_is_token_exact(cluster, prompts, expected, depth, prompt_depth,
                                              swap):
    eos_id, outputs = expected
    # generous liveness limits: a loaded machine must not declare a slow stage dead here
    config = PipelineConfig(depth=depth, batch_size=2, swap=swap, max_seq_len=MAX_SEQ,
                            kv_timeout_s=20, dead_after_s=15)
    c = cluster(config, prompt_depth)
    requests = {f"r{i}": (p, m) for i, (p, m) in enumerate(zip(prompts, LIMITS, strict=True))}
    seqs, first = c.submit(requests, eos_id)
    c.head.wait(30)
    assert [s.error for s in seqs] == [None] * len(seqs)
    assert [s.output_ids for s in seqs] == outputs
    assert [first[rid] for rid in requests] == [out[0] for out in outputs]
    assert c.node0.kv.arena.peak_bytes <= c.node0.kv.arena.budget_bytes
    c.assert_kv_freed()


def test_killed_stage_fails_requests_naming_it_within_bounded_time(cluster, prompts):
    config = PipelineConfig(depth=3, batch_size=2, max_seq_len=MAX_SEQ, heartbeat_s=0.2,
                            dead_after_s=2.0)
    c = cluster(config, 1)
    progressed = threading.Event()

    def on_token(seq: Sequence, token: int | None, done: bool) -> None:
        if len(seq.output_ids) >= 4:
            progressed.set()

    requests = {f"k{i}": (p, 40) for i, p in enumerate(prompts[:6])}
    seqs, _ = c.submit(requests, None, on_token)
    assert progressed.wait(20), "no request made progress"
    c.stages[-1].process.kill()  # SIGKILL the last stage mid-run
    killed_at = time.monotonic()
    c.head.wait(10)
    elapsed = time.monotonic() - killed_at
    assert all(s.finish_reason is FinishReason.ERROR for s in seqs)
    assert all("stage 2" in s.error for s in seqs), seqs[0].error
    assert elapsed < 10
    print(f"all {len(seqs)} requests failed {elapsed:.2f} s after the kill: {seqs[0].error}")
    with pytest.raises(RuntimeError, match="pipeline is down: .*stage 2"):
        c.head.submit_prefilled(Sequence("late", [5, 6], 3))


def test_silent_stage_is_declared_dead_by_its_heartbeats(cluster):
    """No traffic to notice a broken link: the missing heartbeats do."""
    config = PipelineConfig(depth=2, batch_size=1, max_seq_len=MAX_SEQ, heartbeat_s=0.2,
                            dead_after_s=1.5)
    c = cluster(config, 0)
    time.sleep(0.5)
    assert c.head.broken is None
    c.stages[0].process.kill()
    killed_at = time.monotonic()
    while c.head.broken is None and time.monotonic() - killed_at < 8:
        time.sleep(0.05)
    assert c.head.broken is not None, "the dead stage went unnoticed"
    assert re.match(r"stage 1 \(tnode-1-\d+-link\) silent for", c.head.broken), c.head.broken
    print(f"declared dead {time.monotonic() - killed_at:.2f} s after the kill: {c.head.broken}")
    with pytest.raises(RuntimeError, match="pipeline is down"):
        c.head.submit_prefilled(Sequence("late", [5, 6], 3))
