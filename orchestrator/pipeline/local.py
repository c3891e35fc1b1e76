"""A token pipeline in one process (unit tests, benchmarks) on the serving nodes' own code.

:class:`LocalPipeline` is D :class:`~orchestrator.pipeline.node.StageNode` s
wired over an in-process fabric (:class:`~orchestrator.kv.transport.local.LocalFabric`):
the same head, stage workers, transport links, prompt-KV receivers and
heartbeats as T-nodes on separate tritonservers, only the transport differs.
Disaggregated with ``prompt_engines``, it also plays the P-node and the
frontend: each request reserves its prompt KV on every stage, joins the head,
and a prefill thread streams the prompt KV layer by layer into the stages
with the P-node's :func:`~orchestrator.pipeline.prefill.stream_prefill`.
Without ``prompt_engines`` prompt KV comes from elsewhere (``reserve`` and
``head.submit_prefilled``, as a T-node serves it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from orchestrator.engine.base import Engine
from orchestrator.kv.connector import KVSender
from orchestrator.kv.transport.base import Transport
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.pipeline.head import PipelineHead
from orchestrator.pipeline.node import PipelineConfig, StageNode
from orchestrator.pipeline.pipeline import check_chain
from orchestrator.pipeline.prefill import stream_prefill
from orchestrator.pipeline.prefix import PipelinePrefix
from orchestrator.pipeline.sequence import FinishReason
from orchestrator.pipeline.sequence import Sequence as Seq
from orchestrator.pipeline.stage import TIMELINE_KEPT, Interval
from orchestrator.pipeline.swapper import DeviceArena, KVPlacement

log = logging.getLogger(__name__)


class LocalPipeline:
    def __init__(
        self,
        engines: Sequence[Engine],
        config: PipelineConfig,
        *,
        prompt_engines: Sequence[Engine] | None = None,
        prompt_batch: int = 4,
        secret: bytes = b"local-pipeline",
        make_transport: Callable[[str], Transport] | None = None,
    ) -> None:
        """``engines``: one per stage, chaining the model's layers (``config.depth`` and
        ``layers`` follow them); ``prompt_engines``: the P-side's stages (disaggregated; any
        split of the same model). ``make_transport(name)``: every endpoint's transport
        (default: in-process, on one fabric)."""
        check_chain(engines)
        config = replace(config, depth=len(engines),
                         layers=tuple(e.stage.count for e in engines))
        if prompt_engines is not None:
            if config.mode == "colocated":
                raise ValueError("colocated pipelines run their own prompts; drop prompt_engines")
            check_chain(prompt_engines)
        fabric = LocalFabric()
        self.config, self.secret = config, secret
        self.transport = make_transport or (lambda name: LocalTransport(fabric, name))
        self.nodes: list[StageNode] = []
        try:
            for i, engine in enumerate(engines):
                self.nodes.append(StageNode(None, i, config, secret=secret, engine=engine,
                                            make_transport=self.transport))
        except BaseException:
            for node in self.nodes:
                node.close()
            raise
        endpoints = [node.endpoints() for node in self.nodes]
        for i, node in enumerate(self.nodes):
            node.connect(endpoints[(i + 1) % config.depth], endpoints[0])
        self.head: PipelineHead = self.nodes[0].head
        self.prompt_engines = list(prompt_engines or [])
        self.p_side = self.transport("local-pnode")
        self.senders = [KVSender(self.p_side, e.kv_layout, secret, max_inflight=16)
                        for e in self.prompt_engines]
        self.prompt_batch = prompt_batch
        self.prefill_timeline: deque[Interval] = deque(maxlen=TIMELINE_KEPT)
        self._queue: deque[tuple[Seq, list[bytes]]] = deque()
        self._queued = threading.Condition()
        self._stopping = threading.Event()
        self._prefill = threading.Thread(target=self._prefill_loop, name="local-prefill",
                                         daemon=True)
        if self.prompt_engines:  # a request whose prompt KV a failed stage lost: again
            self.head.prefill_again = self._prefill_again

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> LocalPipeline:
        for node in reversed(self.nodes):  # node 0, the head, last
            node.start()
        if self.prompt_engines:
            self._prefill.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the prefill thread, then the nodes (node 0 first: its Shutdown passes every
        stage); requests still running end with an error."""
        self._stopping.set()
        with self._queued:
            self._queued.notify_all()
        if self._prefill.is_alive():
            self._prefill.join(timeout_s)
        for node in self.nodes:
            node.close(timeout_s)
        self.p_side.close()

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests --------------------------------------------------------------------

    def submit(self, seq: Seq) -> Seq:
        """A new request: colocated, the head runs its prompt; disaggregated, its prompt KV
        is reserved on every stage and the prefill thread streams it there."""
        if not self.prompt_engines:
            return self.head.submit(seq)
        tickets = self.reserve(seq.request_id, seq.prompt_len)
        try:
            self.head.submit_prefilled(seq)
        except BaseException:
            for node in self.nodes:
                node.release_prompt(seq.request_id)
            raise
        with self._queued:
            self._queue.append((seq, tickets))
            self._queued.notify()
        return seq

    def _prefill_again(self, seq: Seq) -> None:
        """(During a recovery, under the head's lock) its prompt KV slots on every stage
        afresh, a replacement's too, and its prompt queued once."""
        for node in self.nodes:
            node.release_prompt(seq.request_id)
        tickets = self.reserve(seq.request_id, seq.prompt_len)
        with self._queued:
            for queued in [q for q in self._queue if q[0] is seq]:
                self._queue.remove(queued)
            self._queue.append((seq, tickets))
            self._queued.notify()

    def reuse_prefixes(self, block_tokens: int, capacity_blocks: int) -> PipelinePrefix:
        """A prefix cache on every stage (colocated, before :meth:`start`); returns its
        index, on the head (:meth:`StageNode.reuse_prefixes`)."""
        for node in self.nodes:
            node.reuse_prefixes(block_tokens, capacity_blocks)
        assert self.nodes[0].prefix is not None
        return self.nodes[0].prefix

    def reserve(self, request_id: str, prompt_len: int) -> list[bytes]:
        """A prompt KV slot on every stage: the tickets a P-side streams to."""
        return [node.reserve_prompt(request_id, prompt_len) for node in self.nodes]

    def cancel(self, request_id: str) -> bool:
        return self.head.cancel(request_id)

    def wait(self, timeout_s: float) -> None:
        self.head.wait(timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
                 eos_id: int | None = None, timeout_s: float = 120.0) -> list[list[int]]:
        return self.head.generate(prompts, max_tokens, eos_id, timeout_s, submit=self.submit)

    def _prefill_loop(self) -> None:
        while not self._stopping.is_set():
            with self._queued:
                self._queued.wait_for(lambda: self._queue or self._stopping.is_set())
                batch = [self._queue.popleft()
                         for _ in range(min(self.prompt_batch, len(self._queue)))]
            batch = [(seq, tickets) for seq, tickets in batch if not seq.is_finished]
            if not batch:
                continue
            start = time.monotonic()
            try:
                stream_prefill(self.prompt_engines, self.senders,
                               {s.request_id: s.prompt_ids for s, _ in batch},
                               {s.request_id: t for s, t in batch},
                               {s.request_id: s.sampling for s, _ in batch})
            except Exception as exc:  # the head releases their reservations
                log.exception("prefill failed")
                for seq, _ in batch:
                    seq.finish(FinishReason.ERROR, f"prefill failed: {exc}")
                    self.head.cancel(seq.request_id)
            self.prefill_timeline.append(Interval(start, time.monotonic(), -1, "prefill"))

    # -- what benchmarks and tests read ---------------------------------------------------

    @property
    def errors(self) -> list[str]:
        return list(self.head.errors)

    @property
    def timelines(self) -> list[list[Interval]]:
        return [list(node.worker.timeline) for node in self.nodes]

    @property
    def arenas(self) -> list[DeviceArena]:
        return [node.kv.arena for node in self.nodes]

    @property
    def kv(self) -> list[KVPlacement]:
        return [node.kv for node in self.nodes]

    @property
    def swap(self) -> bool:
        """Every stage swaps its KV (``swap='auto'`` decides per stage)."""
        return all(node.swap for node in self.nodes)

    def kv_held(self) -> int:
        """Sequences whose KV a stage holds, and prompt KV slots still reserved."""
        return sum(len(node.kv) + (node.receiver.held() if node.receiver else 0)
                   for node in self.nodes)
