"""The node-side steps of a recovery plan (DejaVu §4.3, Fig. 10).

1. ``restore_stage``: stage (x+1)%D sends the replica of x it holds to the new x.
2. The new x's replica of (x-1)%D: a fresh :class:`~orchestrator.fault.replication.Replicator`
   on x-1 re-seeds it (``Replicator.seed``), the same KV path as a prompt.
3. The controller picks, per microbatch j, the step t to redo (``make_plan``).
4. ``rollback``: every stage cuts its caches back to the state before step t,
   and the pipeline resumes there. A redone step rewrites the same values.

When no replica survives (the holder died too) the plan says ``recompute``:
every microbatch restarts from its prompt (step 0). The restart-from-scratch
baseline is the same path taken on purpose, with replication off.
"""

from __future__ import annotations

import logging

from orchestrator.engine.base import Engine
from orchestrator.fault.replication import ReplicaStore, send_cache
from orchestrator.kv.connector import KVSender
from orchestrator.kv.layout import KVCache

log = logging.getLogger("dejavu.fault.recovery")


def length_before(step: int, prompt_len: int) -> int:
    """Cache positions filled before ``step`` (step 0 is the prefill, step t >= 1 a decode)."""
    return 0 if step == 0 else prompt_len + step - 1


def resume_steps(plan: dict, microbatches: list[int], recompute: bool) -> dict[int, int]:
    """Step to redo per microbatch; one the controller has no ack for restarts at 0."""
    resume = {int(j): int(t) for j, t in plan["resume"].items()}
    return {j: 0 if recompute else resume.get(j, 0) for j in microbatches}


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


def rollback(caches: dict[str, KVCache], lengths: dict[str, int]) -> None:
    """Step 4 on a surviving stage: forget what the steps to redo wrote."""
    for rid in list(caches):
        length = lengths.get(rid, 0)
        if length == 0:
            del caches[rid]
        elif caches[rid].length < length:
            raise RuntimeError(
                f"request {rid}: stage holds {caches[rid].length} positions, resume needs {length}"
            )
        else:
            caches[rid].length = length
