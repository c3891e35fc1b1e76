"""A token pipeline's stage: one :class:`StageNode` per process (a Triton T-node).

Each node holds one stage (its layers, its engine, its sequences' KV) and runs
a :class:`~orchestrator.pipeline.stage.StageWorker`; node 0 also runs the
:class:`~orchestrator.pipeline.head.PipelineHead` (scheduling, token callbacks,
refill). In-process runs (tests, benchmarks) are the same nodes over an
in-process transport (:class:`~orchestrator.pipeline.local.LocalPipeline`).
Steps go 0 -> 1 -> ... -> D-1 -> back to node 0, each hop one NIXL WRITE into
the next node's ring (:mod:`orchestrator.pipeline.transport_link`).

Bootstrap (a coordinator, e.g. the Triton launcher, carries opaque bytes)::

    config = PipelineConfig(depth=3, batch_size=4, swap="on")   # the same on every node
    node = StageNode(model_dir, stage_index, config, secret=b"...")  # every process
    mine = node.endpoints()                  # bytes: publish to the coordinator
    node.connect(next=endpoints[(i + 1) % depth], head=endpoints[0])
    node.start()                             # nodes 1..D-1 first, node 0 last

Per request (disaggregated: prefilled on a P-node, KV streamed to every stage)::

    tickets = [node_i.reserve_prompt(request_id, prompt_len) for every stage i]  # bytes
    # P-node: KVSender.start(request_id, tickets) ... (``stream_prefill``); the first
    # token rides as the transfer's extra (``encode_first_token``)
    node0.head.submit_prefilled(Sequence(request_id, prompt_ids, max_tokens, eos_id,
                                         on_token=callback))   # right away, no waiting
    node0.head.cancel(request_id)
    node_i.release_prompt(request_id)    # only if never submitted (e.g. the P-node failed)

    node0.close(); node_i.close()        # node 0 first: its Shutdown passes every stage

The head admits a request once a KV probe found its prompt KV complete on every
stage, and fails it with the stage's name if a stage reports the transfer
failed or it is still missing after ``kv_timeout_s``. ``on_token(seq, token,
finished)`` runs on the head's thread (don't block in it): its first call
carries the first token (the P-node's, from the transfer's extra; skip it if
the client already has it), ``token`` None means it ended without one (cancel,
error: ``seq.error`` says which stage). ``reserve_prompt`` raises when all
``prompt_slots`` hold prompts not yet admitted; endpoints and tickets are
~1 KB of opaque bytes.

Liveness: nodes 1..D-1 send node 0 a heartbeat every ``heartbeat_s``; a node
silent for ``dead_after_s``, or a node reporting that it cannot reach its
successor, breaks the pipeline: every request in it fails with an error naming
the stage, and ``submit_prefilled`` refuses new ones. With ``recover_timeout_s``
the head pauses instead and its requests wait for the fault layer to replace
the stage (:mod:`orchestrator.fault.stage_recovery`; ``reconnect`` points a
node at a replaced successor, ``repaired`` resets node 0's liveness view).
``mode="colocated"`` (prompts run inside microbatch steps, stage by stage) needs
no prompt KV receiver.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.engine.base import Engine
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.connector import KVReceiver
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.prefix_cache import BlockPool, PrefixCache
from orchestrator.kv.transport.base import KVPoll, Transport
from orchestrator.layout import KVCache, StageSpec
from orchestrator.pipeline import DEAD_AFTER_S, HEARTBEAT_S, PROMPT_SLOTS, SwapMode
from orchestrator.pipeline.head import PipelineHead
from orchestrator.pipeline.link import Link, QueueLink
from orchestrator.pipeline.pipeline import link_capacity, make_placement, resolve_swap
from orchestrator.pipeline.prefill import decode_first_token
from orchestrator.pipeline.prefix import DecodeReuse, PipelinePrefix
from orchestrator.pipeline.sequence import Sequence
from orchestrator.pipeline.stage import StageWorker
from orchestrator.pipeline.transport_link import LinkTicket, TransportReceiver, TransportSender

log = logging.getLogger(__name__)

_HEARTBEAT, _FAILURE = b"hb:", b"err:"
# A stage that holds no message has settled once what its predecessor sent last is off the
# wire: its own inbox is drained when asked, so this covers only the transfer (well under a
# millisecond between two hosts, microseconds on one). It was 0.3 s of idleness, when a
# message waiting in an unpolled inbox looked quiet: 0.3 s of every repair.
SETTLED_AFTER_S = 0.02


@dataclass(frozen=True)
class PipelineConfig:
    """What every node of one token pipeline must agree on."""

    depth: int
    batch_size: int
    mode: str = "disaggregated"  # or colocated: prompts run in the pipeline's own steps
    num_microbatches: int | None = None  # default: depth
    layers: tuple[int, ...] | None = None  # layers per stage; default: an even split
    swap: SwapMode = SwapMode.OFF  # auto: each stage decides, on its own measurements
    device_kv_budget: int | None = None  # bytes per stage
    swap_workload: tuple[int, int] | None = None  # (prompt_len, new_tokens) for swap=auto
    max_seq_len: int | None = None
    prompt_slots: int = PROMPT_SLOTS
    step_timeout_s: float = 60.0
    kv_timeout_s: float = 30.0
    reserve_ttl_s: float | None = None  # a prompt KV slot reserved and not used is freed
    # after this (its ticket then writes nothing); None: kv_timeout_s, the head's own wait
    heartbeat_s: float = HEARTBEAT_S
    dead_after_s: float = DEAD_AFTER_S
    recover_timeout_s: float | None = None  # a lost stage pauses the head this long for a
    # repair (the fault layer's ``recover_stage``); None: the pipeline breaks at once
    prefill_chunk: int = 0  # colocated: a step's token budget (chunked prefill); 0: whole

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or self.depth


class ReceiverKVSource:
    """A stage's prompt KV, streamed by P-nodes into its ``KVReceiver`` (a PromptKVSource)."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self._request_ids: dict[int, str] = {}  # seq id -> request id, learnt from probes
        # seq id -> request id of the sequences taken in: a new head re-attaches them by it
        self.taken: dict[int, str] = {}
        self._lock = threading.Lock()

    def probe(self, seq_id: int, request_id: str, stage_index: int) -> tuple[KVPoll, str]:
        with self._lock:
            self._request_ids[seq_id] = request_id
        try:
            state = self.receiver.poll(request_id)
            if state in (KVPoll.SUCCESS, KVPoll.FAILED):
                _, extra = self.receiver.wait(request_id, timeout_s=0)
                return KVPoll.SUCCESS, str(decode_first_token(extra))
        except KeyError:
            return KVPoll.FAILED, "no KV slot was reserved for it on this stage"
        except (KVTransferError, ValueError) as exc:
            return KVPoll.FAILED, str(exc)
        return state, ""

    def take(self, seq_id: int, stage_index: int) -> KVCache:
        """A copy of the prompt's positions; the receiver's slot goes back to its pool now."""
        with self._lock:
            request_id = self._request_ids.pop(seq_id)
            self.taken[seq_id] = request_id
        slot = self.receiver.cache(request_id)
        cache = KVCache(slot.layout, slot.layout.allocate("cpu"), slot.length)
        cache.data[:, :, :, : slot.length].copy_(slot.data[:, :, :, : slot.length])
        self.receiver.release(request_id)
        return cache

    def discard(self, seq_id: int, request_id: str | None = None) -> None:
        with self._lock:
            self.taken.pop(seq_id, None)
            request_id = self._request_ids.pop(seq_id, None) or request_id
        if request_id is not None:
            self.receiver.release(request_id)


class StageNode:
    """One stage of a token pipeline in this process; node 0 also holds the head."""

    def __init__(
        self,
        model_dir: str | Path | None,
        stage_index: int,
        config: PipelineConfig,
        *,
        secret: bytes,
        device: str = "cpu",
        make_transport: Callable[[str], Transport] | None = None,
        name: str | None = None,
        engine: Engine | None = None,
    ) -> None:
        """``make_transport(name)``: the KV transport (default NIXL); a node makes two, one
        for its ring and one for its prompt KV, since each drains its own notifications.
        ``name``: unique in the cluster (its transports are ``<name>-link``, ``<name>-kv``).
        ``engine``: an already loaded stage engine (else loaded from ``model_dir``)."""
        if (model_dir is None) == (engine is None):
            raise ValueError("give model_dir or an engine")
        if not 0 <= stage_index < config.depth:
            raise ValueError(f"stage_index {stage_index} not in [0, {config.depth})")
        if make_transport is None:
            from orchestrator.kv.transport.nixl import stage_transport

            make_transport = stage_transport
        self.index, self.config = stage_index, config
        self.name = name or f"tnode-{stage_index}-{os.getpid()}"
        num_layers = (ModelConfig.from_dir(model_dir).num_layers if engine is None
                      else engine.stage.num_layers)
        spec = StageSpec.split(num_layers, config.depth, config.layers)[stage_index]
        if engine is None:
            kwargs = {} if config.max_seq_len is None else {"max_seq_len": config.max_seq_len}
            engine = load_engine(model_dir, spec, device, **kwargs)
        elif engine.stage != spec:
            raise ValueError(f"stage {stage_index} of {config.depth} holds {spec}, "
                             f"the engine given holds {engine.stage}")
        self.engine = engine
        mbs, batch = config.microbatches, config.batch_size
        self.swap = resolve_swap([engine], config.swap, config.device_kv_budget,
                                 config.swap_workload, mbs, batch)
        self.kv = make_placement(engine, batch, mbs, self.swap, config.device_kv_budget)

        self.kv_transport: Transport | None = None
        self.receiver: KVReceiver | None = None  # prompt KV from P-nodes (disaggregated)
        self.prompt_kv: ReceiverKVSource | None = None
        if config.mode != "colocated":
            self.kv_transport = make_transport(f"{self.name}-kv")
            self.receiver = KVReceiver(self.kv_transport, engine.kv_layout,
                                       config.prompt_slots, secret,
                                       timeout_s=config.kv_timeout_s,
                                       reserve_ttl_s=config.reserve_ttl_s or config.kv_timeout_s)
            self.prompt_kv = ReceiverKVSource(self.receiver)
        self.decode_reuse: DecodeReuse | None = None  # :meth:`keep_finished`
        self.blocks: BlockPool | None = None  # colocated: :meth:`reuse_prefixes`
        self.prefix: PipelinePrefix | None = None  # node 0 of those: the blocks' index
        self._secret = secret

        capacity = link_capacity(mbs)
        self.link_transport: Transport | None = None
        self.ring: TransportReceiver | None = None  # node 0: answers; others: the inbox
        if config.depth > 1:
            self.link_transport = make_transport(f"{self.name}-link")
            self.ring = TransportReceiver(self.link_transport, capacity, self._slot_bytes())
        self._head_link: QueueLink | None = None
        self.head: PipelineHead | None = None
        if stage_index == 0:
            self._head_link = QueueLink("head->stage-0", capacity)
            results: Link = self.ring or QueueLink("stage-0->head", capacity)
            self.head = PipelineHead(
                self._head_link, results, num_microbatches=mbs, batch_size=batch,
                max_seq_len=engine.kv_layout.max_seq_len, mode=config.mode,
                step_timeout_s=config.step_timeout_s,
                kv_timeout_s=config.kv_timeout_s, health=self._health,
                recover_timeout_s=config.recover_timeout_s, prefill_chunk=config.prefill_chunk,
            )
        self.worker: StageWorker | None = None
        self._head_node: str | None = None  # the head's transport name (nodes 1..D-1)
        self._beats: dict[int, tuple[str, float]] = {}  # node 0: stage -> (node, last beat)
        self._reported: list[str] = []
        # Told the stage it cannot reach (its successor) when a send fails: the transport's
        # disconnect is a faster sign of a lost node than its silence (the fault controller).
        self.on_unreachable: Callable[[int], None] | None = None
        self._started_at = 0.0
        self._stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        if config.depth == 1:  # the stage answers its own head, on the head's thread
            self._make_worker(self.head.from_last)
            self.head.run_stage = self.worker.run_pending

    # -- bootstrap ------------------------------------------------------------------

    def endpoints(self) -> bytes:
        """Opaque bytes for the coordinator: where the previous node writes (node 0: where the
        last node writes the tokens back)."""
        ticket = self.ring.ticket().to_dict() if self.ring is not None else None
        return json.dumps({"stage": self.index, "depth": self.config.depth,
                           "ring": ticket}).encode()

    def connect(self, next: bytes, head: bytes) -> None:  # noqa: A002  (the API's word)
        """Wire this node to its successor's endpoints (the last node: node 0's) and to node
        0's (heartbeats and failure reports go to the head)."""
        if self.config.depth == 1:
            return
        succ, first = self._successor(next), self._endpoints_of("head", head, 0)
        assert self.link_transport is not None
        self._make_worker(TransportSender(self.link_transport, succ))
        if self.index > 0:
            ticket = LinkTicket.from_dict(first["ring"])
            self.link_transport.add_peer(ticket.node, ticket.metadata)
            self._head_node = ticket.node

    def reconnect(self, next: bytes) -> None:  # noqa: A002  (the API's word)
        """Fault recovery: the successor was replaced (a new process, new endpoints), or the
        connection to it dropped (its same endpoints); steps go there from now on. Call it
        between steps (a paused, drained pipeline): a message in flight to the old
        successor is lost with it."""
        if self.worker is None or self.config.depth == 1:
            raise RuntimeError(f"stage {self.index}: nothing to reconnect (connect() first)")
        succ = self._successor(next)
        old = self.worker.outbox
        assert isinstance(old, TransportSender) and self.link_transport is not None
        self.worker.outbox = TransportSender(self.link_transport, succ)
        self.link_transport.deregister(old.staging)
        if old.ticket.node != succ.node:
            self.link_transport.remove_peer(old.ticket.node)

    def follow_head(self, head: bytes) -> None:
        """Fault recovery, nodes 1..D-1: node 0 was replaced (new endpoints); heartbeats and
        failure reports go to the new one from now on."""
        if self.index == 0:
            raise RuntimeError("node 0 holds the head")
        ticket = LinkTicket.from_dict(self._endpoints_of("head", head, 0)["ring"])
        assert self.link_transport is not None
        self.link_transport.add_peer(ticket.node, ticket.metadata)  # (the last stage's
        self._head_node = ticket.node  # reconnect may have added it: the same peer)

    def drop_link(self) -> None:
        """Fault drill: lose the connection to the successor (its process lives on); the
        next step this stage sends fails, as over a broken network link."""
        assert isinstance(self.worker.outbox, TransportSender) and self.link_transport
        self.link_transport.remove_peer(self.worker.outbox.ticket.node)

    def quiet(self, for_s: float = SETTLED_AFTER_S) -> bool:
        """This stage holds no message and handled none for ``for_s`` seconds (recovery: a
        paused pipeline has settled here)."""
        return self.worker is not None and self.worker.quiet(for_s)

    def sequences(self) -> dict[int, tuple[str, int]]:
        """Each sequence whose KV this stage holds: its request id (known to a stage that
        took its prompt KV in), its KV length. Ended ones are forgotten here."""
        held = {s: c.length for s, c in self.kv.held().items()}
        taken = self.prompt_kv.taken if self.prompt_kv is not None else {}
        for seq_id in [s for s in taken if s not in held]:
            taken.pop(seq_id, None)
        return {s: (taken[s], n) for s, n in held.items() if s in taken}

    def repaired(self) -> None:
        """Node 0, after a repair: forget the failures seen and the lost stage's heartbeats
        (its replacement beats under a new name)."""
        self._reported.clear()
        self._beats.clear()
        self._started_at = time.monotonic()

    def _successor(self, endpoints: bytes) -> LinkTicket:
        want = (self.index + 1) % self.config.depth
        return LinkTicket.from_dict(self._endpoints_of("next", endpoints, want)["ring"])

    def _endpoints_of(self, what: str, endpoints: bytes, expected: int) -> dict:
        got = json.loads(endpoints)
        if got["stage"] != expected or got["depth"] != self.config.depth:
            raise ValueError(f"stage {self.index}: {what} endpoints are of stage "
                             f"{got['stage']}/{got['depth']}, expected "
                             f"{expected}/{self.config.depth}")
        return got

    def start(self) -> StageNode:
        if self.worker is None:
            raise RuntimeError(f"stage {self.index}: connect() before start()")
        self._started_at = time.monotonic()
        if self.config.depth > 1:
            self.worker.start()
        if self._head_node is not None:
            self._heartbeat.start()
        if self.head is not None:
            self.head.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Node 0: stop the head (a Shutdown passes through every stage). Then free the
        transports."""
        if self.head is not None:
            self.head.stop(timeout_s)
        self._stopping.set()
        if self.worker is not None and self.worker.thread.is_alive():
            # after node 0's close, the Shutdown has passed (or the pipeline is broken)
            self.worker.thread.join(min(timeout_s, 1.0))
        if self.receiver is not None:
            self.receiver.close()
        for transport in (self.kv_transport, self.link_transport):
            if transport is not None:
                transport.close()

    # -- prompt KV ---------------------------------------------------------------------

    def reserve_prompt(self, request_id: str, prompt_len: int,
                       prompt: list[int] | None = None, salt: str = "") -> bytes:
        """A KV slot for the request's prompt on this stage; the ticket goes to the P-node.
        With ``prompt`` (its ids, under ``salt``) and decode-side reuse, the slot starts with
        the prompt's blocks this node kept, and the ticket asks only for the rest."""
        fill = None
        if prompt is not None and self.decode_reuse is not None:
            fill = self.decode_reuse.fill(prompt, salt)
        return self._receiver().reserve(request_id, prompt_len, fill)

    def reuse_prefixes(self, block_tokens: int, capacity_blocks: int) -> None:
        """Prefill on top of cached prompt KV (colocated; the same sizes on every node): this
        stage keeps its layers of ``capacity_blocks`` blocks of ``block_tokens`` tokens, and
        node 0's head the blocks' index (:mod:`orchestrator.pipeline.prefix`). Before the
        pipeline starts."""
        if self.config.mode != "colocated":
            raise ValueError("a pipeline's prefix cache needs a colocated pipeline (a P-node "
                             "keeps its own)")
        self.blocks = BlockPool(self.engine.kv_layout, block_tokens, capacity_blocks,
                                self.engine.device)
        if self.worker is not None:
            self.worker.blocks = self.blocks
        if self.head is not None:
            self.prefix = PipelinePrefix(PrefixCache(self.engine.kv_layout, block_tokens,
                                                     capacity_blocks, keep_kv=False),
                                         self._secret)
            self.head.scheduler.prefix = self.prefix

    def keep_finished(self, reuse: DecodeReuse) -> None:
        """Keep finished requests' KV in ``reuse`` for their next turns (decode-side reuse:
        a pipeline's only stage, which holds every layer)."""
        if self.config.depth != 1 or self.receiver is None:
            raise ValueError("decode-side reuse needs a disaggregated pipeline of depth 1")
        self.decode_reuse = reuse

    def keep(self, seq: Sequence) -> None:
        """``seq`` ended normally: keep its KV for its next turn (decode-side reuse). On the
        head's thread, which runs this pipeline's only stage: its KV is still here."""
        if self.decode_reuse is not None:
            self.decode_reuse.keep(seq.prompt_ids + seq.output_ids, seq.cache_salt,
                                   self.kv.held().get(seq.seq_id))

    def release_prompt(self, request_id: str) -> None:
        """Free a reservation whose request was never submitted (submitted ones are freed by
        the pipeline)."""
        self._receiver().release(request_id)

    def _receiver(self) -> KVReceiver:
        if self.receiver is None:
            raise ValueError(f"stage {self.index}: a colocated pipeline takes no prompt KV")
        return self.receiver

    # -- liveness ---------------------------------------------------------------------

    def _make_worker(self, outbox: Link) -> None:
        inbox = self._head_link if self.index == 0 else self.ring
        assert inbox is not None
        self.worker = StageWorker(
            self.index, self.engine, self.kv, inbox, outbox, self.config.microbatches,
            self.prompt_kv, send_timeout_s=self.config.step_timeout_s, report=self._report,
        )
        self.worker.blocks = self.blocks

    def _report(self, error: str) -> None:
        if self.on_unreachable is not None:
            try:
                self.on_unreachable((self.index + 1) % self.config.depth)
            except Exception:  # the heartbeat timeout still finds a lost node
                log.exception("stage %d: could not report its successor", self.index)
        if self.head is not None:
            self.head.report_failure(error)
        else:
            self._notify_head(_FAILURE + f"{self.index}:{error}".encode())

    def _beat(self) -> None:
        """Beat while the stage worker lives: a node whose worker died reads as dead."""
        note = _HEARTBEAT + str(self.index).encode()
        while not self._stopping.wait(self.config.heartbeat_s):
            if self.worker is None or not self.worker.thread.is_alive():
                log.info("stage %d: worker thread ended; heartbeats stop", self.index)
                return
            self._notify_head(note)

    def _notify_head(self, note: bytes) -> None:
        assert self.link_transport is not None and self._head_node is not None
        try:
            self.link_transport.notify(self._head_node, note)
        except ConnectionError as exc:
            log.warning("stage %d: cannot reach the head: %s", self.index, exc)

    def _health(self) -> str | None:
        """Node 0's head asks: has a stage reported a failure, or gone silent?"""
        if self.ring is None:
            return None
        now = time.monotonic()
        while self.ring.control:
            peer, note = self.ring.control.popleft()
            if note.startswith(_HEARTBEAT):
                self._beats[int(note[len(_HEARTBEAT):])] = (peer, now)
            elif note.startswith(_FAILURE):
                self._reported.append(note[len(_FAILURE):].split(b":", 1)[1].decode())
        if self._reported:
            return self._reported[0]
        for stage in range(1, self.config.depth):
            peer, last = self._beats.get(stage, ("never heard from", self._started_at))
            if now - last > self.config.dead_after_s:
                return (f"stage {stage} ({peer}) silent for {now - last:.1f} s "
                        f"(heartbeat every {self.config.heartbeat_s} s): presumed dead")
        return None

    def _slot_bytes(self) -> int:
        """One step message: a JSON header (ids, sampling of admitted sequences) and a
        [batch, hidden] tensor (colocated: and the prompts' [length, hidden] each)."""
        rows = self.config.batch_size
        if self.config.mode == "colocated":
            rows += self.config.batch_size * self.engine.kv_layout.max_seq_len
        return (64 << 10) + rows * self.engine.hidden_size * 8
