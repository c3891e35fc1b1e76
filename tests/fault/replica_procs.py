"""A spawned stage node with KV replication, for the cross-process replication tests.

The test plays node 0 (head and stage 0) and the coordinator carrying endpoints
between processes, as ``tests/pipeline/stage_procs.py`` does for plain pipelines.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from spawned import serve

SECRET = b"replica-test-secret"


def replicated_stage(model_dir: Path, stage_index: int, config: dict, inbox: mp.Queue,
                     outbox: mp.Queue) -> None:
    """Answers ``(ok, value)`` to: ``("connect", next, head)`` (returns its replication
    endpoints), ``("replicate", next, previous)``, ``("start",)``, ``("reserve", rid, n)``,
    ``("flush",)``, ``("own",)``, ``("replicas", lengths)``, ``("held",)``, ``("landed",)``,
    ``("adopt", lengths, sampling)``, ``("close",)``."""
    import torch

    from orchestrator.engine.sampling import SamplingParams
    from orchestrator.fault.node_replication import NodeReplication
    from orchestrator.pipeline.node import PipelineConfig, StageNode

    torch.set_num_threads(1)
    node = StageNode(model_dir, stage_index, PipelineConfig(**config), secret=SECRET)
    replication: list[NodeReplication] = []

    def connect(next_: bytes, head: bytes) -> bytes:
        node.connect(next_, head)
        replication.append(NodeReplication(node, SECRET))
        return replication[0].endpoints()

    handlers = {
        "connect": connect,
        "replicate": lambda n, p: replication[0].connect(n, p),
        "start": lambda: node.start() and None,
        "reserve": node.reserve_prompt,
        "flush": lambda: replication[0].flush(),
        "own": lambda: replication[0].own_digests(),
        "replicas": lambda lengths: replication[0].replica_digests(lengths),
        "held": lambda: (len(node.kv), replication[0].held()),
        "landed": lambda: dict(replication[0].landed),
        "adopt": lambda lengths, sampling: replication[0].adopt(
            lengths, {s: SamplingParams(**p) for s, p in sampling.items()}),
    }
    outbox.put((True, node.endpoints()))
    def close() -> None:
        for r in replication:
            r.close()
        node.close()

    serve(handlers, close, inbox, outbox)
