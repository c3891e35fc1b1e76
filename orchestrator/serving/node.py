"""Build a node's serving objects from its model parameters (set per node by the launcher).

Parameters: ``model_dir``, ``max_seq_len`` (KV slot size, optional), ``secret``
(hex, shared by every node of a cluster: KV blocks and tickets are signed with
it), ``name`` (the node's transport name), and on a T-node ``mode``
(``disaggregated`` or ``colocated``), ``num_slots`` and ``max_batch``.
"""

from __future__ import annotations

import torch

from orchestrator.engine.torch_engine import TorchEngine, load_engine
from orchestrator.serving.decode_service import DecodeService
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.prefill_worker import PrefillWorker


def _engine(params: dict[str, str]) -> TorchEngine:
    torch.set_num_threads(int(params.get("threads", "1")))  # nodes share the machine's cores
    max_seq_len = int(params["max_seq_len"]) if params.get("max_seq_len") else None
    return load_engine(params["model_dir"], max_seq_len=max_seq_len)


def _transport(params: dict[str, str]):
    from orchestrator.kv.transport.nixl import NixlTransport  # loads UCX: only where needed

    return NixlTransport(name=params.get("name") or None)


def load_prefill_worker(params: dict[str, str], metrics: Metrics | None = None) -> PrefillWorker:
    from orchestrator.kv.connector import KVSender

    engine = _engine(params)
    sender = KVSender(_transport(params), engine.kv_layout, bytes.fromhex(params["secret"]))
    return PrefillWorker(engine, sender, metrics=metrics)


def load_decode_service(params: dict[str, str], metrics: Metrics | None = None) -> DecodeService:
    engine = _engine(params)
    max_batch = int(params.get("max_batch", "16"))
    mode = params.get("mode", "disaggregated")
    if mode == "colocated":
        return DecodeService(engine, None, max_batch, metrics=metrics)
    if mode != "disaggregated":
        raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
    from orchestrator.kv.connector import KVReceiver

    receiver = KVReceiver(
        _transport(params),
        engine.kv_layout,
        int(params.get("num_slots", str(max_batch))),
        bytes.fromhex(params["secret"]),
    )
    return DecodeService(engine, receiver, max_batch, metrics=metrics)
