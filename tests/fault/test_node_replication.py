"""KV replicas across real processes: a depth-2 token pipeline of StageNodes (stage 1 in a
spawned process, NIXL loopback), each streaming its per-step KV deltas to the other.

Mid-run the head pauses and drains; every replica then equals its source's KV byte for
byte (both directions cross a process boundary) and the holders acked every microbatch's
steps; after the requests end their replicas are freed. Tokens stay exact. A stage
process killed with SIGKILL between requests is replaced by a new process that node 0
reconnects to (ring and replicas); the pipeline serves and replicates on.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import torch
from replica_procs import SECRET, Landings, own_digests, replica_digests, replicated_stage
from spawned import Child

from orchestrator.engine.reference import generate, load_stages
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.nixl import NixlTransport
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.prefill import stream_prefill
from orchestrator.pipeline.sequence import Sequence

pytestmark = pytest.mark.slow  # stage 1 in a spawned process
MAX_SEQ = 64
LIMITS = [14, 10, 16, 12, 6]
CONFIG = PipelineConfig(depth=2, batch_size=2, max_seq_len=MAX_SEQ, kv_timeout_s=20,
                        dead_after_s=15)  # generous: a loaded machine must not break it


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gpt2")


@pytest.fixture(scope="module")
def prefill_engines(model):
    return load_stages(model, 1, max_seq_len=MAX_SEQ)


def make_requests(prefill_engines, seed: int, limits: list[int] = LIMITS
                  ) -> tuple[dict, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist()
               for n in torch.randint(3, 15, (len(limits),), generator=g).tolist()]
    expected = [generate(prefill_engines, [p], m)[0] for p, m in zip(prompts, limits, strict=True)]
    return {f"s{seed}r{i}": (p, m) for i, (p, m) in enumerate(zip(prompts, limits, strict=True))}, \
        expected


def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s} s")
        time.sleep(0.02)


class Pair:
    """Node 0 (head, stage 0, a P-stage's sender) here; stage 1 in a spawned process."""

    def __init__(self, model, prefill_engines) -> None:
        self.model, self.prefill_engines = model, prefill_engines
        self.node0 = StageNode(model, 0, CONFIG, secret=SECRET)
        self.child = Child(replicated_stage, model, 1, asdict(CONFIG))
        self.endpoints0 = self.node0.endpoints()
        endpoints1 = self.child.answer()
        repl1 = self.child.call("connect", self.endpoints0, self.endpoints0)
        self.node0.connect(endpoints1, self.endpoints0)
        self.landed0 = Landings()
        self.replication0 = NodeReplication(self.node0, SECRET, ack=self.landed0)
        self.child.call("replicate", self.replication0.endpoints(), self.replication0.endpoints())
        self.replication0.connect(repl1, repl1)
        self.child.call("start")
        self.head = self.node0.start().head
        self.pnode = NixlTransport("pnode-replica-test")
        self.sender = KVSender(self.pnode, prefill_engines[0].kv_layout, SECRET, max_inflight=16)

    def replace_stage_1(self, restore: dict[str, int] | None = None,
                        sampling: dict[int, dict] | None = None) -> None:
        """SIGKILL stage 1's process; a new one joins, node 0 reconnects to it and (if
        ``restore``) sends it those sequences' KV from the replicas it holds."""
        self.child.process.kill()
        self.child.process.join(10)
        self.child = Child(replicated_stage, self.model, 1, asdict(CONFIG))
        endpoints1 = self.child.answer()
        repl1 = self.child.call("connect", self.endpoints0, self.endpoints0)
        self.child.call("replicate", self.replication0.endpoints(), self.replication0.endpoints())
        self.node0.reconnect(endpoints1)
        self.replication0.reconnect(repl1)
        if restore:
            self.replication0.restore(repl1, restore)
            self.child.call("adopt", restore, sampling or {})
        self.child.call("start")

    def run(self, requests: dict, expected: list[list[int]], replace: bool = False) -> None:
        """Serve ``requests``; mid-run, pause and check every replica against its source
        (``replace``: then kill stage 1 and restore it into a new process from its replicas)."""
        tokens = [0]

        def on_token(seq, token, finished) -> None:
            tokens[0] += 1

        tickets = {rid: [self.node0.reserve_prompt(rid, len(p)),
                         self.child.call("reserve", rid, len(p))]
                   for rid, (p, _) in requests.items()}
        seqs = [self.head.submit_prefilled(Sequence(rid, p, m, None, on_token=on_token))
                for rid, (p, m) in requests.items()]
        stream_prefill(self.prefill_engines, [self.sender],
                       {r: p for r, (p, _) in requests.items()}, tickets)
        # A replaced stage has lost the prompt KV of requests not admitted yet (they would be
        # prefilled again): before a kill, every request runs.
        until((lambda: all(len(s.output_ids) >= 2 for s in seqs)) if replace
              else (lambda: tokens[0] >= 12), 30, "tokens before the pause")
        self.head.pause()
        self.head.drain(self.node0._head_link, 20)  # nothing in flight: KV is between steps
        self.check_replicas()
        if replace:
            lengths = {rid: n for rid, (n, _) in self.child.call("own").items()}
            sampling = {s.seq_id: asdict(s.sampling) for s in self.head.running()}
            self.replace_stage_1(lengths, sampling)
        self.head.resume()
        self.head.wait(60)
        assert [s.error for s in seqs] == [None] * len(seqs)
        assert [s.output_ids for s in seqs] == expected
        until(lambda: self.child.call("held") == (0, []) and len(self.node0.kv) == 0
              and self.replication0.held() == [], 10, "KV and replicas freed")

    def check_replicas(self) -> None:
        self.replication0.flush()
        self.child.call("flush")
        own0, own1 = own_digests(self.replication0), self.child.call("own")
        assert own0 and own0.keys() == own1.keys()
        held_by_1 = self.child.call("replicas", {rid: n for rid, (n, _) in own0.items()})
        held_by_0 = replica_digests(self.replication0, {rid: n for rid, (n, _) in own1.items()})
        assert held_by_1 == {rid: d for rid, (_, d) in own0.items()}
        assert held_by_0 == {rid: d for rid, (_, d) in own1.items()}
        # each holder acked steps of both microbatches
        assert set(self.landed0.steps) == set(self.child.call("landed")) == {0, 1}

    def close(self) -> None:
        self.node0.close(timeout_s=5)
        self.child.close()
        self.replication0.close()
        self.pnode.close()


@pytest.fixture
def pair(model, prefill_engines):
    made = Pair(model, prefill_engines)
    yield made
    made.close()


def test_stage_node_replicas_equal_source_kv_and_are_freed(pair, prefill_engines):
    pair.run(*make_requests(prefill_engines, 11))


def test_replaced_stage_process_is_reconnected_and_replicated_to(pair, prefill_engines):
    pair.run(*make_requests(prefill_engines, 12))
    pair.replace_stage_1()
    pair.run(*make_requests(prefill_engines, 13))
    with pytest.raises(ValueError, match="expected 1/2"):
        pair.node0.reconnect(pair.endpoints0)  # node 0's own endpoints are not stage 1's
    with pytest.raises(ValueError, match="stage 0, expected 1"):
        pair.replication0.reconnect(pair.replication0.endpoints())


def test_stage_killed_mid_run_is_restored_from_its_replicas_token_exact(pair, prefill_engines):
    """Settled (paused and drained, every ack in): SIGKILL stage 1 with requests half done
    (as many as the pipeline's slots, all admitted);
    node 0 restores its KV into a new process from the replicas; every request completes
    with the failure-free run's tokens."""
    pair.run(*make_requests(prefill_engines, 14, LIMITS[:4]), replace=True)
