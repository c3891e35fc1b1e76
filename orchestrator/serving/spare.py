"""A warm spare T-node: loaded and on standby, it takes over a lost stage of a token pipeline.

``dejavu up --spares N`` starts N of them beside the pipelines. A spare loads
the engine of every stage it may take (any stage; stage 0 comes with the
pipeline's head, which starts empty: the requests it held run again from their
prompts) and makes each one's stage node ahead of time (its KV transports, pools and replica stores:
0.5-0.6 s when made at the takeover, on 2 loaded cores), so taking a role costs
neither a process start, nor a model load, nor an allocation. It registers
with the fault controller only once it holds a stage: the supervisor calls
``assume`` (pipeline, stage) once the controller declared the stage's node
dead, then carries out the controller's recovery plan with the spare in the
lost slot (:func:`orchestrator.fault.stage_recovery.recover_stage`). From then
on it is that stage, and every control op goes to its
:class:`~orchestrator.serving.token_service.TokenService`.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from orchestrator.engine.config import ModelConfig
from orchestrator.engine.factory import load_stage_engine
from orchestrator.fault.client import ControllerClient
from orchestrator.fault.node_replication import NodeReplication
from orchestrator.kv.transport.base import Transport
from orchestrator.layout import StageSpec
from orchestrator.serving.config import NodeConfig, Role
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.node import StageParts, connect_controller, stage_parts, stage_service
from orchestrator.serving.params import RequestError
from orchestrator.serving.token_service import ControlRequest, TokenService

TRANSPORTS = ("kv", "link", "replica")  # a stage node's and its replication's


class SpareService:
    """Serves like a :class:`TokenService` once ``assume`` made it one."""

    def __init__(self, config: NodeConfig, metrics: Metrics | None = None) -> None:
        from orchestrator.kv.transport.nixl import stage_transport  # loads UCX: only here

        self.config, self.metrics = config, metrics or Metrics()
        specs = StageSpec.split(ModelConfig.from_dir(config.model_dir).num_layers, config.depth)
        self.stages: dict[int, StageParts] = {}
        for x in range(config.depth):
            name = f"{config.name}-s{x}"
            transports: dict[str, Transport] = {f"{name}-{kind}": stage_transport(
                f"{name}-{kind}") for kind in TRANSPORTS}
            engine = load_stage_engine(config.model_dir, specs[x], config.device,
                                       config.profile, config.max_seq_len, config.time_scale)
            node, replication = stage_parts(replace(config, role=Role.DECODE, stage=x), engine,
                                            transports.pop, name)
            if isinstance(replication, NodeReplication):  # its predecessor's replicas too
                # (stage 0 holds the last stage's; a layout that differs is made at connect)
                previous = specs[x - 1]
                replication.hold(replace(
                    engine.kv_layout, first_layer=previous.first_layer,
                    num_layers=previous.last_layer - previous.first_layer))
            self.stages[x] = (node, replication)
        self.controller: ControllerClient | None = None
        self.service: TokenService | None = None
        self.lock = threading.Lock()

    def control(self, op: str, request: ControlRequest) -> bytes:
        if op == "assume":
            self._assume(request.args)
            return b""
        if op == "standby":
            return b"1" if self.service is None else b"0"
        return self._serving(op).control(op, request)

    def admit(self, request_id: str, *args, **kwargs) -> None:
        self._serving("generate").admit(request_id, *args, **kwargs)

    def open_feed(self, *args, **kwargs) -> None:
        self._serving("feed").open_feed(*args, **kwargs)

    def cancel(self, request_id: str) -> bool:
        return self.service is not None and self.service.cancel(request_id)

    def _serving(self, op: str) -> TokenService:
        if self.service is None:
            raise RequestError(f"op {op!r}: this spare is on standby (it holds no stage)")
        return self.service

    def _assume(self, peers: tuple[bytes, ...]) -> None:
        """Become stage ``peers[1]`` of token pipeline ``peers[0]``."""
        if len(peers) != 2:
            raise RequestError("op 'assume' needs peers = [pipeline, stage]")
        pipeline, stage = (int(p) for p in peers)
        with self.lock:
            if self.service is not None:
                raise RequestError("this spare already holds a stage")
            if stage not in self.stages:
                raise RequestError(f"a spare takes stage 0..{len(self.stages) - 1}, not {stage}")
            config = replace(self.config, role=Role.DECODE, pipeline=pipeline, stage=stage)
            self.controller = connect_controller(config)
            self.service = stage_service(config, self.metrics, self.controller,
                                         parts=self.stages.pop(stage))
            self._close_stages()  # the other stages' weights and KV are not needed any more

    def _close_stages(self) -> None:
        for node, replication in self.stages.values():
            if replication is not None:
                replication.close()
            node.close()
        self.stages.clear()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.controller is not None:
            self.controller.stop()
        if self.service is not None:
            self.service.stop(timeout_s)
        self._close_stages()  # those it did not take
