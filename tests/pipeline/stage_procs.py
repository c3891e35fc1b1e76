"""Child-process roles for the multi-process pipeline tests (spawned, so importable here).

Each child answers commands from the test, which plays the coordinator (what
the Triton launcher and the orchestrator model do in a deployment): it
carries endpoints and tickets between processes as opaque bytes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from pathlib import Path

SECRET = b"pipeline-test-secret"
COMMAND_TIMEOUT_S = 60.0


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
    while True:
        command, *args = inbox.get(timeout=COMMAND_TIMEOUT_S)
        if command == "close":
            node.close()
            outbox.put((True, None))
            return
        try:
            outbox.put((True, handlers[command](*args)))
        except Exception:
            outbox.put((False, traceback.format_exc()))


def prompt_node(model_dir: Path, depth: int, max_seq_len: int, inbox: mp.Queue,
                outbox: mp.Queue) -> None:
    """A P-worker with ``depth`` prompt stages: ``("prefill", {rid: ids}, {rid: tickets})``
    answers ``(ok, {rid: first token})``."""
    import torch

    from orchestrator.engine.reference import load_stages
    from orchestrator.kv.connector import KVSender
    from orchestrator.kv.transport.nixl import NixlTransport
    from orchestrator.pipeline.prompt_worker import stream_prefill

    torch.set_num_threads(1)
    engines = load_stages(str(model_dir), depth, max_seq_len=max_seq_len)
    transport = NixlTransport("pnode")
    senders = [KVSender(transport, e.kv_layout, SECRET, max_inflight=16) for e in engines]
    outbox.put((True, None))
    while True:
        command, *args = inbox.get(timeout=COMMAND_TIMEOUT_S)
        if command == "close":
            transport.close()
            outbox.put((True, None))
            return
        try:
            outbox.put((True, stream_prefill(engines, senders, *args)))
        except Exception:
            outbox.put((False, traceback.format_exc()))


class Child:
    """A spawned role and its command queues."""

    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=target, args=(*args, self.inbox, self.outbox),
                                   daemon=True)
        self.process.start()

    def answer(self, timeout_s: float = COMMAND_TIMEOUT_S):
        ok, value = self.outbox.get(timeout=timeout_s)
        if not ok:
            raise RuntimeError(f"child {self.process.pid} failed:\n{value}")
        return value

    def call(self, *command, timeout_s: float = COMMAND_TIMEOUT_S):
        self.inbox.put(command)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):  # a dead or stuck child is killed below
                self.call("close", timeout_s=10)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
