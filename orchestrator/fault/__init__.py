"""Fault tolerance (DejaVu §4.3): a controller process, KV replicas on the next stage, recovery.

- ``controller``: registration, heartbeats, acks, failure detection, recovery plans.
- ``client``: the node side of the controller (heartbeat thread, acks, plans).
- ``replication``: stage x streams its KV to stage (x+1)%D's host memory (or disk).
- ``recovery``: the four recovery steps, the recompute fallback, the restart baseline.
- ``drill``: an in-process pipeline of engine stages that fails and recovers a stage.
"""
