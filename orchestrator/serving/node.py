"""Build a node's serving objects from its model parameters (set per node by the launcher).

Parameters: ``model_dir``, ``max_seq_len`` (KV slot size, optional), ``secret``
(hex, shared by every node of a cluster: KV blocks and tickets are signed with
it), ``name`` (the node's transport name); on a P-node ``prefill_depth`` (prompt
stages, all in this process); on a T-node ``mode`` (``disaggregated`` or
``colocated``), ``depth`` and ``stage`` (its place in its token pipeline),
``max_batch`` (sequences per microbatch), ``swap`` (on | off | auto),
``num_slots`` (prompt KVs it can hold before their requests are admitted),
``dead_after_s`` (a stage silent this long is lost), ``replicate`` (on: stream
KV replicas to the next stage; disk: write them to ``replica_dir`` on local
disk; either way a lost stage pauses the pipeline for up to
``recover_timeout_s`` until it is replaced; off: it breaks the pipeline). Every
node: ``controller`` (the fault controller's address; empty: none), ``address``
(its own gRPC url) and ``pipeline`` (the index of its P- or T-pipeline).
"""

from __future__ import annotations

import torch

from orchestrator.engine.reference import load_stages
from orchestrator.engine.torch_engine import load_engine
from orchestrator.fault import REPLICATE_MODES
from orchestrator.fault.client import ControllerClient, NodeSpec
from orchestrator.fault.disk_replication import DiskReplication
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.fault.stage_recovery import RecoveryOps
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.pipeline import TokenPipeline
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.prefill_worker import PrefillWorker
from orchestrator.serving.token_service import TokenService


def _max_seq_len(params: dict[str, str]) -> int | None:
    return int(params["max_seq_len"]) if params.get("max_seq_len") else None


def _set_threads(params: dict[str, str]) -> None:
    torch.set_num_threads(int(params.get("threads", "1")))  # nodes share the machine's cores


def _device(params: dict[str, str]) -> str:
    """Where the engine runs: a node given GPUs (``devices`` cuda:...) sees only those."""
    return "cuda" if params.get("devices", "").startswith("cuda") else "cpu"


def load_prefill_worker(params: dict[str, str], metrics: Metrics | None = None) -> PrefillWorker:
    from orchestrator.kv.connector import KVSender
    from orchestrator.kv.transport.nixl import NixlTransport  # loads UCX: only where needed

    _set_threads(params)
    depth = int(params.get("prefill_depth", "1"))
    engines = load_stages(params["model_dir"], depth, device=_device(params),
                          max_seq_len=_max_seq_len(params))
    transport = NixlTransport(name=params.get("name") or None)
    secret = bytes.fromhex(params["secret"])
    senders = [KVSender(transport, e.kv_layout, secret, max_inflight=16) for e in engines]
    return PrefillWorker(engines, senders, metrics=metrics)


def load_token_service(params: dict[str, str], metrics: Metrics | None = None,
                       controller: ControllerClient | None = None) -> TokenService:
    """``controller``: the node's controller client (replication acks go through it)."""
    _set_threads(params)
    mode, depth = params.get("mode", "disaggregated"), int(params.get("depth", "1"))
    batch, swap = int(params.get("max_batch", "16")), params.get("swap", "off")
    if mode == "colocated":
        if depth != 1:
            raise ValueError("colocated T-nodes run depth-1 pipelines only (got depth "
                             f"{depth}): prompts cannot yet enter a pipeline across nodes")
        engine = load_engine(params["model_dir"], device=_device(params),
                             max_seq_len=_max_seq_len(params))
        pipeline = TokenPipeline([engine], batch, mode="colocated", swap=swap).start()
        return TokenService(engine, pipeline=pipeline, metrics=metrics)
    if mode != "disaggregated":
        raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
    slots = {"prompt_slots": int(params["num_slots"])} if params.get("num_slots") else {}
    replication_mode = params.get("replicate", "off")
    if replication_mode not in REPLICATE_MODES:
        raise ValueError(f"replicate must be one of {REPLICATE_MODES}, got {replication_mode!r}")
    replicate = replication_mode != "off" and depth > 1
    config = PipelineConfig(
        depth=depth, batch_size=batch, swap=swap, max_seq_len=_max_seq_len(params),
        dead_after_s=float(params.get("dead_after_s", "10")),
        recover_timeout_s=float(params.get("recover_timeout_s", "120")) if replicate else None,
        **slots,
    )
    secret = bytes.fromhex(params["secret"])
    node = StageNode(params["model_dir"], int(params.get("stage", "0")), config,
                     secret=secret, device=_device(params), name=params.get("name") or None)
    if depth == 1:  # nothing to connect: serve at once (also where no launcher bootstraps)
        node.start()
    recovery = None
    if replicate:
        ack = None if controller is None else controller.ack
        replication = (NodeReplication(node, secret, ack=ack) if replication_mode == "on"
                       else DiskReplication(node, params["replica_dir"], ack=ack))
        recovery = RecoveryOps(node, replication, controller)
    return TokenService(node.engine, node=node, recovery=recovery, metrics=metrics)


def connect_controller(params: dict[str, str], role: str) -> ControllerClient | None:
    """Register with the fault controller and heartbeat (``role``: prompt | token); None
    when the node has no controller. Stop the client when the model is unloaded."""
    if not params.get("controller"):
        return None
    token = role == "token"
    spec = NodeSpec(
        pipeline=f"{'decode' if token else 'prefill'}{params.get('pipeline', '0')}",
        stage=int(params.get("stage", "0")) if token else 0,
        depth=int(params.get("depth", "1")) if token else 1,  # a P-node's stages: one process
        role=role,
        address=params.get("address", ""),
    )
    return ControllerClient(params["controller"], spec, heartbeat_s=0.5,
                            node_id=params.get("name") or None).start()
