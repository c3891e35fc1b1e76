"""Replication alone: a stage's replica on its holder follows it step by step, and is freed.

Recovery on the token pipeline: ``test_replicated.py``."""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.reference import load_stages
from orchestrator.fault.replication import ReplicaStore, Replicator
from orchestrator.kv.transport.local import LocalFabric, LocalTransport

MAX_SEQ = 64


def test_replica_follows_the_source_and_is_freed(tiny_model) -> None:
    """The holder's replica equals the stage's own KV after each acked step."""
    (engine,) = load_stages(str(tiny_model("gpt2")), 1, max_seq_len=MAX_SEQ)
    fabric = LocalFabric()
    source, holder = LocalTransport(fabric, "src"), LocalTransport(fabric, "holder")
    source.add_peer("holder", holder.metadata())
    acks: list[tuple[int, int, int]] = []
    store = ReplicaStore(holder, engine.kv_layout, 4, b"s", lambda *a: acks.append(a))
    replicator = Replicator(0, source, engine.kv_layout, b"s", store, max_batch=2)
    caches = [engine.new_cache(), engine.new_cache()]
    logits = engine.prefill([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], caches)
    replicator.step(7, 0, ["a", "b"], caches)
    tokens = torch.stack(logits).argmax(-1)
    for step in range(1, 6):
        tokens = engine.decode(tokens, caches).argmax(-1)
        replicator.step(7, step, ["a", "b"], caches)
        store.progress()
    replicator.flush()
    assert acks[-1] == (0, 7, 5) and [a[2] for a in acks] == sorted(a[2] for a in acks)
    for rid, cache in zip("ab", caches, strict=True):
        n = cache.length
        assert torch.equal(store.replica(rid, n).data[:, :, :, :n], cache.data[:, :, :, :n])
    with pytest.raises(RuntimeError, match="holds 8 positions, 9 needed"):
        store.replica("a", 9)
    replicator.remove("a")
    replicator.remove("b")
    replicator.flush()
    assert store.held == [] and store.receiver.held() == 0  # the slots are free too
    replicator.close()
