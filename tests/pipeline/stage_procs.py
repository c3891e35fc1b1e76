"""Child-process roles for the multi-process pipeline tests (spawned, so importable here).

Each child answers commands from the test, which plays the coordinator (what
the Triton launcher and the orchestrator model do in a deployment): it
carries endpoints and tickets between processes as opaque bytes.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from spawned import serve

SECRET = b"pipeline-test-secret"


def stage_node(model_dir: Path, stage_index: int, config: dict, inbox: mp.Queue,
               outbox: mp.Queue) -> None:
    """A token stage: ``("connect", next, head)``, ``("start",)``, ``("reserve", rid, n)``,
    ``("release", rid)``, ``("held",)`` (sequences whose KV it holds), ``("close",)``; every
    answer is ``(ok, value)``."""
    import torch

    from orchestrator.pipeline.node import PipelineConfig, StageNode

    torch.set_num_threads(1)
    node = StageNode(model_dir, stage_index, PipelineConfig(**config), secret=SECRET)
    def start() -> None:
        node.start()

    def held() -> int:
        return len(node.kv)

    handlers = {"connect": node.connect, "start": start, "reserve": node.reserve_prompt,
                "release": node.release_prompt, "held": held}
    outbox.put((True, node.endpoints()))
    serve(handlers, node.close, inbox, outbox)


def prompt_node(model_dir: Path, depth: int, max_seq_len: int, inbox: mp.Queue,
                outbox: mp.Queue) -> None:
    """A P-worker with ``depth`` prompt stages: ``("prefill", {rid: ids}, {rid: tickets})``
    answers ``(ok, {rid: first token})``."""
    import torch

    from orchestrator.engine.reference import load_stages
    from orchestrator.kv.connector import KVSender
    from orchestrator.kv.transport.nixl import NixlTransport
    from orchestrator.pipeline.prefill import stream_prefill

    torch.set_num_threads(1)
    engines = load_stages(str(model_dir), depth, max_seq_len=max_seq_len)
    transport = NixlTransport("pnode")
    senders = [KVSender(transport, e.kv_layout, SECRET, max_inflight=16) for e in engines]
    outbox.put((True, None))
    serve({"prefill": lambda *args: stream_prefill(engines, senders, *args)}, transport.close,
          inbox, outbox)
