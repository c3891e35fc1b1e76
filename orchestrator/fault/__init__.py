"""Fault tolerance (DejaVu §4.3): a controller process, KV replicas on the next stage, recovery.

- ``controller``: registration, heartbeats, acks, failure detection, recovery plans.
- ``client``: the node side of the controller (heartbeat thread, acks, recovery reports).
- ``replication``: stage x streams its KV to stage (x+1)%D's host memory.
- ``node_replication``: the same replicas across processes, for a ``StageNode``
  (holder's control calls over gRPC, KV over the node's own NIXL endpoint).
- ``disk_replication``: a ``StageNode``'s replicas on its own local disk instead.
- ``stage_recovery``: the four recovery steps (DejaVu §4.3, Fig. 10) as a T-node's
  operations, and their order across nodes (a lost stage replaced; a dropped
  connection made again).

The same nodes, replicas and steps on an in-process pipeline, with kill drills, the
recompute fallback and the restart baseline, are the tests' drill
(``tests/fault/replicated_pipeline.py``).
"""


from enum import StrEnum


class ReplicateMode(StrEnum):
    """Where a T-stage keeps its KV replicas (pipelines deeper than 1)."""

    ON = "on"  # in the next stage's host memory
    DISK = "disk"  # on its own local disk
    OFF = "off"  # none: a lost stage costs its pipeline's requests a rerun
