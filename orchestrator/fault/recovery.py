"""The steps of a recovery plan (DejaVu §4.3, Fig. 10), and where each lives.

1. ``restore_stage``: stage (x+1)%D sends the replica of x it holds to the new x.
2. The new x's replica of (x-1)%D: a fresh :class:`~orchestrator.fault.replication.Replicator`
   on x-1 re-seeds it (``Replicator.seed``), the same KV path as a prompt.
3. The controller picks, per microbatch j, the step t to redo
   (:func:`~orchestrator.fault.controller.make_plan`).
4. The pipeline head rewinds to (j, t) (``PipelineHead.rewind``), every stage
   cuts its KV back to the state before t (``KVPlacement.rollback``), and the
   head resumes there. A redone step rewrites the same values.
:class:`~orchestrator.fault.replicated.ReplicatedPipeline` carries them out.

When no replica survives (the holder died too) the plan says ``recompute``:
every running request starts over from its prompt. The restart-from-scratch
baseline is the same path taken on purpose, with replication off.
"""

from __future__ import annotations

from orchestrator.engine.base import Engine
from orchestrator.fault.replication import ReplicaStore, send_cache
from orchestrator.kv.connector import KVSender
from orchestrator.layout import KVCache


def restore_stage(
    holder_store: ReplicaStore,
    sender: KVSender,
    inbox: ReplicaStore,
    engine: Engine,
    lengths: dict[str, int],
    timeout_s: float,
) -> dict[str, KVCache]:
    """Step 1: the holder sends each request's replica (``lengths`` positions) to the new stage.

    ``sender`` is the holder's, with the failed stage's layout; ``inbox`` the new
    stage's landing pool. Returns the new stage's own caches.
    """
    restored = {}
    for rid, length in lengths.items():
        if length == 0:
            continue  # redone from the prompt
        replica = holder_store.replica(rid, length)
        send_cache(sender, rid, replica, inbox.open(rid, length), timeout_s)
        cache = engine.new_cache()
        cache.data.copy_(inbox.replica(rid, length).data)
        cache.length = length
        inbox.free(rid)
        restored[rid] = cache
    return restored
