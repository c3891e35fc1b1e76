"""Replicas on local disk (the SSD variant), as a unit: a stage's KV deltas land in files
step by step, a new incarnation of the stage reads them back byte for byte, a rollback
cuts them, and an ended sequence's file goes. (On tritonservers: test_stage_faults.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from orchestrator.engine.torch_engine import load_engine
from orchestrator.fault.disk_replication import DiskReplication
from orchestrator.pipeline.pipeline import make_placement


def stage_node(model, index: int = 1):
    """What DiskReplication uses of a StageNode: its index, engine, KV and worker hooks."""
    engine = load_engine(model, max_seq_len=64)
    worker = SimpleNamespace(on_step=None, on_release=None, is_last=True, samplers={})
    return SimpleNamespace(index=index, engine=engine, worker=worker,
                           kv=make_placement(engine, 2, 1, False, None))


def test_deltas_on_disk_come_back_after_a_restart(tiny_model, tmp_path):
    model = tiny_model("gpt2")
    node, acks = stage_node(model), []
    replication = DiskReplication(node, tmp_path, ack=lambda *a: acks.append(a))
    replication.connect(b"", b"")
    prompts = {0: torch.tensor([5, 9, 13, 2]), 1: torch.tensor([7, 3])}
    for seq_id in prompts:
        node.kv.add(seq_id, None)
    caches = node.kv.open(0, list(prompts))
    logits = node.engine.prefill(list(prompts.values()), caches)
    node.worker.on_step(0, 0, list(prompts), caches)
    tokens = torch.stack([row.argmax() for row in logits])
    for step in (1, 2, 3):
        tokens = node.engine.decode(tokens, caches).argmax(-1)
        node.worker.on_step(0, step, list(prompts), caches)
    assert acks == [(1, 0, 0), (1, 0, 1), (1, 0, 2), (1, 0, 3)]
    assert replication.held() == ["0", "1"]

    # The process dies; its successor on the same disk reads the files back.
    kept = {s: c.length for s, c in node.kv.held().items()}
    new = stage_node(model)
    again = DiskReplication(new, tmp_path)
    again.connect(b"", b"")
    again.adopt({str(s): n for s, n in kept.items()})
    for seq_id, cache in node.kv.held().items():
        restored = new.kv.held()[seq_id]
        assert restored.length == cache.length
        assert torch.equal(restored.data[:, :, :, :cache.length],
                           cache.data[:, :, :, :cache.length])

    again.rollback({0: kept[0] - 2})  # sequence 1 redone from its prompt: its file goes
    assert again.held() == ["0"] and new.kv.held()[0].length == kept[0] - 2
    new.worker.on_release(0)
    assert again.held_counts() == {"replicas": 0, "landing": 0}
    assert not list(tmp_path.glob("*.kv"))
