"""A node's serving objects, built from its :class:`~orchestrator.serving.config.NodeConfig`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.factory import load_stage_engine, load_stage_engines
from orchestrator.fault import ReplicateMode
from orchestrator.fault.client import ControllerClient, NodeSpec
from orchestrator.fault.disk_replication import DiskReplication
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.fault.stage_recovery import RecoveryOps
from orchestrator.kv.prefix_cache import blocks_within
from orchestrator.kv.transport.base import Transport
from orchestrator.layout import StageSpec
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.prefix import DecodeReuse, PrefixReuse
from orchestrator.serving.config import Mode, NodeConfig, Role
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.prefill_worker import PrefillWorker
from orchestrator.serving.token_service import TokenService


def load_prefill_worker(config: NodeConfig, metrics: Metrics | None = None) -> PrefillWorker:
    from orchestrator.kv.connector import KVSender
    from orchestrator.kv.transport.nixl import NixlTransport  # loads UCX: only where needed

    torch.set_num_threads(config.threads)
    engines = load_stage_engines(config.model_dir, config.prefill_depth, config.device,
                                 config.profile, config.max_seq_len, config.time_scale)
    transport = NixlTransport(name=config.name or None)
    secret = config.secret()
    senders = [KVSender(transport, e.kv_layout, secret, max_inflight=16) for e in engines]
    return PrefillWorker(engines, senders, metrics=metrics, prefix=prefix_reuse(config, engines))


def prefix_reuse(config: NodeConfig, engines: list[Engine], budget_mb: float | None = None,
                 kind: type[PrefixReuse] = PrefixReuse) -> PrefixReuse | None:
    """The prefix cache of a node that prefills on ``engines`` (its stages, in order), within
    ``budget_mb`` (default its ``prefix_cache_mb``); None when that is 0. ``kind``:
    :class:`DecodeReuse` for a T-node's cache of finished requests."""
    budget_mb = config.prefix_cache_mb if budget_mb is None else budget_mb
    if not budget_mb:
        return None
    from orchestrator.kv.prefix_cache import PrefixCache

    first, last = engines[0].kv_layout, engines[-1].kv_layout
    layout = replace(first, num_layers=last.first_layer + last.num_layers - first.first_layer)
    return kind(PrefixCache.within(layout, config.kv_block, int(budget_mb * 2**20),
                                   device=engines[0].device), config.secret())


def pipeline_prefix_blocks(config: NodeConfig, engine: Engine) -> int:
    """The blocks every stage of a colocated pipeline keeps (the same on each: they hold
    the head's block indices) within ``prefix_cache_mb``: as many as its largest stage's
    layers fit (the stages of a model split evenly, as :class:`StageNode` splits it)."""
    stages = StageSpec.split(ModelConfig.from_dir(config.model_dir).num_layers, config.depth)
    largest = replace(engine.kv_layout, num_layers=max(s.count for s in stages))
    return blocks_within(largest, config.kv_block, int(config.prefix_cache_mb * 2**20))


def load_token_service(config: NodeConfig, metrics: Metrics | None = None,
                       controller: ControllerClient | None = None) -> TokenService:
    """``controller``: the node's controller client (replication acks go through it)."""
    torch.set_num_threads(config.threads)
    if config.role is Role.SPARE:
        from orchestrator.serving.spare import SpareService  # it builds its stage with ours

        return SpareService(config, metrics)  # type: ignore[return-value]  (serves as one)
    return stage_service(config, metrics, controller)


StageParts = tuple[StageNode, NodeReplication | DiskReplication | None]


def stage_parts(config: NodeConfig, engine: Engine | None = None,
                make_transport: Callable[[str], Transport] | None = None,
                name: str | None = None) -> StageParts:
    """Stage ``config.stage``'s node and its replication, not yet tied to a controller: what
    takes memory and registrations (a warm spare makes these on standby). ``engine`` and
    ``make_transport``: loaded and made already (else here); ``name``: the node's (default:
    the config's)."""
    slots = {"prompt_slots": config.num_slots} if config.num_slots else {}
    pipeline_config = PipelineConfig(
        depth=config.depth, batch_size=config.max_batch, mode=config.mode, swap=config.swap,
        max_seq_len=config.max_seq_len, heartbeat_s=config.heartbeat_s,
        dead_after_s=config.dead_after_s, reserve_ttl_s=config.reserve_ttl_s,
        # A K-times slower engine queues K times longer before its prompt KV lands.
        kv_timeout_s=PipelineConfig.kv_timeout_s * config.time_scale,
        recover_timeout_s=config.recover_timeout_s if config.replicates else None,
        prefill_chunk=config.prefill_chunk, **slots,
    )
    secret = config.secret()
    if engine is None and config.profile:  # the emulated engine: StageNode loads only torch's
        spec = StageSpec.split(ModelConfig.from_dir(config.model_dir).num_layers,
                               config.depth)[config.stage]
        engine = load_stage_engine(config.model_dir, spec, config.device, config.profile,
                                   config.max_seq_len, config.time_scale)
    model_dir = None if engine is not None else config.model_dir  # one or the other
    node = StageNode(model_dir, config.stage, pipeline_config, secret=secret,
                     device=config.device, name=name or config.name or None, engine=engine,
                     make_transport=make_transport)
    if not config.replicates:
        return node, None
    host = config.address.rpartition(":")[0] or "127.0.0.1"
    return node, (NodeReplication(node, secret, host=host, make_transport=make_transport)
                  if config.replicate is ReplicateMode.ON
                  else DiskReplication(node, config.replica_dir))


def stage_service(config: NodeConfig, metrics: Metrics | None,
                  controller: ControllerClient | None, engine: Engine | None = None,
                  make_transport: Callable[[str], Transport] | None = None,
                  parts: StageParts | None = None) -> TokenService:
    """One stage of a token pipeline (colocated: its prompts run in its own steps);
    ``engine`` and ``make_transport``: what a warm spare loaded and made ahead of time (else
    loaded and made here); ``parts``: its node and replication, made ahead of time too."""
    node, replication = parts or stage_parts(config, engine, make_transport)
    if controller is not None:  # a successor it cannot reach: tell the controller at once
        node.on_unreachable = controller.suspect
        if node.receiver is not None:  # a lost P-node's slots are free once it is declared
            controller.on_ended = node.receiver.writers_ended
    # It prefills: reuse prompt KV (whole prompts or chunks after the cached blocks)
    if config.mode is Mode.COLOCATED and config.prefix_cache_mb:
        node.reuse_prefixes(config.kv_block, pipeline_prefix_blocks(config, node.engine))
    # It decodes the whole model: keep finished requests' KV for their next turns
    if config.mode is not Mode.COLOCATED and config.depth == 1 and config.decode_cache_mb:
        node.keep_finished(prefix_reuse(config, [node.engine], config.decode_cache_mb,
                                        DecodeReuse))  # type: ignore[arg-type]  (its kind)
    if config.depth == 1:  # nothing to connect: serve at once (also where no launcher bootstraps)
        node.start()
    recovery = None
    if replication is not None:
        replication.ack = None if controller is None else controller.ack
        recovery = RecoveryOps(node, replication, controller)
    return TokenService(node.engine, node=node, recovery=recovery, metrics=metrics)


def connect_controller(config: NodeConfig) -> ControllerClient | None:
    """Register with the fault controller and heartbeat; None when the node has no
    controller. Stop the client when the model is unloaded."""
    if not config.controller or config.role.spare:
        return None  # a spare registers once it holds a role
    token = config.role is Role.DECODE
    spec = NodeSpec(
        pipeline=f"{config.role.value}{config.pipeline}",
        stage=config.stage if token else 0,
        depth=config.depth if token else 1,  # a P-node's stages: one process
        role="token" if token else "prompt",
        address=config.address,
    )
    server = os.getppid()  # the stub's tritonserver: a stub left behind must not beat
    return ControllerClient(config.controller, spec, config.secret(),
                            heartbeat_s=config.heartbeat_s, node_id=config.name or None,
                            alive=lambda: os.getppid() == server).start()
