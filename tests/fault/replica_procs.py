"""A spawned stage node with KV replication, for the cross-process replication tests, and
the checks both sides run on their replicas (digests, landed steps).

The test plays node 0 (head and stage 0) and the coordinator carrying endpoints
between processes, as ``tests/pipeline/stage_procs.py`` does for plain pipelines.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from spawned import serve

if TYPE_CHECKING:
    from orchestrator.fault.node_replication import NodeReplication
    from orchestrator.layout import KVCache

SECRET = b"replica-test-secret"


def kv_digest(cache: KVCache, length: int | None = None) -> str:
    """SHA-256 of a cache's first ``length`` positions (default: all it holds), every layer."""
    length = cache.length if length is None else length
    return hashlib.sha256(cache.data[:, :, :, :length].contiguous().numpy().tobytes()).hexdigest()


def replica_digests(replication: NodeReplication, lengths: dict[str, int]) -> dict[str, str]:
    """Digests of the predecessor's replicas held there, ``lengths`` positions each."""
    store = replication.store
    assert store is not None
    store.progress()
    return {rid: kv_digest(store.replica(rid, n), n) for rid, n in lengths.items()}


def own_digests(replication: NodeReplication) -> dict[str, tuple[int, str]]:
    """A stage's own KV, per sequence: (positions, digest). Call it between steps (a paused
    and drained pipeline)."""
    return {str(s): (c.length, kv_digest(c)) for s, c in replication.node.kv.held().items()}


class Landings:
    """A holder's ``ack`` callback that records, per microbatch, the last step of the
    predecessor landed (called on the replica server's threads)."""

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self, source_stage: int, microbatch: int, step: int) -> None:
        with self._lock:
            self.steps[microbatch] = max(step, self.steps.get(microbatch, -1))


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
    landings = Landings()

    def connect(next_: bytes, head: bytes) -> bytes:
        node.connect(next_, head)
        replication.append(NodeReplication(node, SECRET, ack=landings))
        return replication[0].endpoints()

    handlers = {
        "connect": connect,
        "replicate": lambda n, p: replication[0].connect(n, p),
        "start": lambda: node.start() and None,
        "reserve": node.reserve_prompt,
        "flush": lambda: replication[0].flush(),
        "own": lambda: own_digests(replication[0]),
        "replicas": lambda lengths: replica_digests(replication[0], lengths),
        "held": lambda: (len(node.kv), replication[0].held()),
        "landed": lambda: dict(landings.steps),
        "adopt": lambda lengths, sampling: replication[0].adopt(
            lengths, {s: SamplingParams(**p) for s, p in sampling.items()}),
    }
    outbox.put((True, node.endpoints()))
    def close() -> None:
        for r in replication:
            r.close()
        node.close()

    serve(handlers, close, inbox, outbox)
