"""A stage worker: one engine stage, its sequences' KV, one thread (a pipeline's only stage
runs on its head's thread instead).

It takes microbatch steps from the previous stage's link, computes its layers
and sends the result on; the last stage samples and sends the tokens back to
the head. Torch ops release the GIL, so in one process the stages really do
overlap, and each stage's timeline of busy intervals shows where the bubbles
are. The worker does not care where its neighbours run: its links are
in-process queues or transport links into other processes.

A :class:`~orchestrator.pipeline.link.KVProbe` asks each stage whether prompt
KV prefilled elsewhere has landed in its :class:`PromptKVSource` (alone, or riding on a
step: answered after the step's layers); the head admits a request only once every
stage said yes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.sampling import Sampler
from orchestrator.kv.prefix_cache import BlockPool
from orchestrator.kv.transport.base import KVPoll
from orchestrator.layout import KVCache
from orchestrator.pipeline.link import (
    KVProbe,
    Link,
    LinkError,
    LinkTimeout,
    Message,
    Shutdown,
    StepMessage,
    TokenMessage,
)
from orchestrator.pipeline.swapper import KVPlacement

log = logging.getLogger(__name__)
TIMELINE_KEPT = 10_000  # busy intervals a long-lived stage keeps (the latest; benches read them)


class PromptKVSource(Protocol):
    """Where a token stage finds a prompt's KV that a prompt worker computed."""

    def probe(self, seq_id: int, request_id: str, stage_index: int) -> tuple[KVPoll, str]:
        """The KV's state here; with SUCCESS the first token (as text, ``""`` if unknown),
        with FAILED the reason."""
        ...

    def take(self, seq_id: int, stage_index: int) -> KVCache:
        """The complete prompt KV of an admitted sequence (the source lets go of it)."""
        ...

    def discard(self, seq_id: int, request_id: str | None = None) -> None:
        """Drop a prompt KV that will never be taken (cancelled, failed), or forget a taken
        one (its sequence ended); no-op if unknown."""
        ...


@dataclass(frozen=True)
class Interval:
    """The stage computed ``microbatch`` from ``start`` to ``end`` (monotonic seconds)."""

    start: float
    end: float
    microbatch: int
    kind: str  # "decode", "prefill" or "prefill+decode"


StepHook = Callable[[int, int, list[int], list[KVCache]], None]


class StageLost(BaseException):
    """Raised by a hook to end the stage's thread at once, sending nothing: what a crash
    does (fault drills). Not an ``Exception``: no step error is reported downstream."""


class StageWorker:
    def __init__(
        self,
        index: int,
        engine: Engine,
        kv: KVPlacement,
        inbox: Link,
        outbox: Link,
        num_microbatches: int,
        prompt_kv: PromptKVSource | None = None,
        send_timeout_s: float = 60.0,
        poll_s: float = 0.05,
        report: Callable[[str], None] | None = None,
        on_step: StepHook | None = None,
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        """``report(error)``: told when a message cannot be sent on (the next stage is gone);
        a remote stage forwards it to the head, which fails the requests.

        Fault-tolerance hooks (no-ops when None): ``on_step(microbatch, step, seq_ids,
        caches)`` after each step's compute, with the caches it wrote (replicate the delta);
        ``on_release(seq_id)`` when a sequence's KV is freed here (drop its replica)."""
        self.index, self.engine, self.kv = index, engine, kv
        self.inbox, self.outbox = inbox, outbox
        self.num_microbatches = num_microbatches
        self.prompt_kv = prompt_kv
        self.send_timeout_s, self.poll_s = send_timeout_s, poll_s
        self.report = report
        self.on_step, self.on_release = on_step, on_release
        self.is_last = engine.stage.is_last
        self.samplers: dict[int, Sampler] = {}  # last stage only
        self.members: dict[int, list[int]] = {}  # microbatch -> its sequences, as last seen
        self._followed_by: dict[int, int] = {}  # microbatch -> the one that came after it
        self._previous: int | None = None
        self.timeline: deque[Interval] = deque(maxlen=TIMELINE_KEPT)
        # Colocated with a prefix cache: this stage's layers of the blocks the head indexes
        # (set by its node); a step names the blocks to load and to keep.
        self.blocks: BlockPool | None = None
        self._handling = False  # a message taken and not yet passed on
        self._handled = 0  # messages handled (the inbox counts those it gave out)
        self._last_handled = time.monotonic()
        self._retired = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"stage-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def retire(self, timeout_s: float = 10.0) -> None:
        """Take no more messages (fault drills: the stage is lost); waits for the thread
        unless called on it. A step being computed finishes first."""
        self._retired.set()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        while not self._retired.is_set():
            message = self.inbox.recv(self.poll_s)
            if message is not None and not self.handle(message):
                return

    def run_pending(self) -> None:
        """Handle every message waiting in the inbox, on the caller's thread (a pipeline's
        only stage runs on its head's: no hand-off between two threads per step)."""
        while (message := self.inbox.recv(0)) is not None:
            self.handle(message)

    def handle(self, message: Message) -> bool:
        """Compute and pass on one message; False when the stage must stop."""
        self._handling = True
        try:
            return self._handle(message)
        finally:
            self._handled += 1
            self._handling, self._last_handled = False, time.monotonic()

    def quiet(self, for_s: float) -> bool:
        """Nothing handled for ``for_s`` seconds, nothing taken from the inbox and not yet
        handled, nothing arrived in it: with no new work coming in (a paused head), this
        stage has settled. ``for_s`` only covers a message still on the wire."""
        return (not self._handling and self.inbox.received == self._handled
                and not self.inbox.waiting()
                and time.monotonic() - self._last_handled > for_s)

    def _handle(self, message: Message) -> bool:
        """Compute and pass on one message; False when the thread must end."""
        if isinstance(message, Shutdown):
            out: Shutdown | StepMessage | TokenMessage | KVProbe = message
        elif isinstance(message, KVProbe):
            out = self._probe_safely(message)
        else:
            try:
                out = self._process_safely(message)
            except StageLost:
                log.warning("stage %d lost at microbatch %d step %d", self.index,
                            message.microbatch, message.step)
                return False
            if message.probe is not None:  # after the layers: KV landed meanwhile counts
                out.probe = self._probe_safely(message.probe)
        try:
            self.outbox.send(out, self.send_timeout_s)
        except (LinkTimeout, LinkError) as exc:
            # Keep serving: the head hears of it and stops sending; a repaired link
            # (fault recovery) finds this stage still running.
            peer = "the head" if self.is_last else f"stage {self.index + 1}"
            error = f"stage {self.index} cannot send to {peer}: {exc}"
            log.error("%s", error)
            if self.report is not None and not isinstance(message, Shutdown):
                self.report(error)
        if isinstance(message, Shutdown):
            self.kv.shutdown()
            return False
        return True

    def _probe_safely(self, probe: KVProbe) -> KVProbe:
        try:
            return self.probe(probe)
        except Exception as exc:
            log.exception("stage %d failed a KV probe", self.index)
            failed = {s: f"stage {self.index}: probing prompt KV: {exc}" for s in probe.requests}
            return replace(probe, requests={}, failed=probe.failed | failed)

    def probe(self, probe: KVProbe) -> KVProbe:
        """Keep the requests whose prompt KV is complete here; the last stage adds their
        first tokens."""
        if self.prompt_kv is None:
            raise RuntimeError("probed for prompt KV, but this stage has no prompt KV source")
        for seq_id, request_id in probe.release.items():
            self.prompt_kv.discard(seq_id, request_id)
        out = KVProbe({}, probe.release, dict(probe.ready), dict(probe.failed),
                      dict(probe.waiting_at))
        for seq_id, request_id in probe.requests.items():
            state, detail = self.prompt_kv.probe(seq_id, request_id, self.index)
            if state is KVPoll.FAILED:
                out.failed[seq_id] = f"stage {self.index}: prompt KV of {request_id!r}: {detail}"
            elif state is not KVPoll.SUCCESS:
                out.waiting_at[seq_id] = self.index
            elif not self.is_last:
                out.requests[seq_id] = request_id
            elif detail.isdigit():
                out.ready[seq_id] = int(detail)
            else:
                out.failed[seq_id] = (f"stage {self.index}: prompt KV of {request_id!r} came "
                                      f"without a first token ({detail!r})")
        return out

    def _process_safely(self, message: StepMessage) -> StepMessage | TokenMessage:
        if message.error is None:
            try:
                return self.process(message)
            except Exception as exc:
                log.exception("stage %d failed microbatch %d", self.index, message.microbatch)
                message = replace(message, error=f"stage {self.index}: {exc}")
        self._forget(message.release)
        if self.is_last:
            return TokenMessage(message.microbatch, message.step, {}, message.error)
        return message

    def process(self, message: StepMessage) -> StepMessage | TokenMessage:
        mb = message.microbatch
        self._forget(message.release)
        for seq_id in message.admit:
            if seq_id in message.resume:  # re-attached: its KV is here already
                self.kv.cut(seq_id, message.resume[seq_id])
                continue
            if self.prompt_kv is None:
                raise RuntimeError("sequences admitted with prompt KV, but no prompt KV source")
            self.kv.add(seq_id, self.prompt_kv.take(seq_id, self.index))
        for seq_id in message.prompt_seq_ids:
            if seq_id not in self.kv:  # a prompt's first chunk (later ones extend its KV)
                self.kv.add(seq_id, None)
        if self.is_last:
            self.samplers.update({s: Sampler(p) for s, p in message.sampling.items()})

        seq_ids = message.prompt_seq_ids + message.seq_ids
        caches = self.kv.open(mb, seq_ids) if seq_ids else []
        # While this microbatch computes, bring the next one's KV in (swapping only).
        following = self._next_microbatch(mb)
        self.kv.prefetch(following, self.members.get(following, []))

        self._load_blocks(message, caches)
        prompt_out, step_out = self._compute(message, caches) if seq_ids else ([], None)
        self._keep_blocks(message, caches)
        if self.on_step is not None and seq_ids:
            self.on_step(mb, message.step, seq_ids, caches)
        self.kv.close(mb, seq_ids)
        self.members[mb] = seq_ids
        if not self.is_last:
            return replace(message, inputs=step_out, prompts=prompt_out)
        partial = set(message.partial)
        rows = [(seq_id, logits) for seq_id, logits in
                zip(message.prompt_seq_ids, prompt_out, strict=True) if seq_id not in partial]
        if step_out is not None:
            rows += zip(message.seq_ids, step_out, strict=True)
        answer = TokenMessage(mb, message.step, {})
        for seq_id, logits in rows:
            answer.tokens[seq_id], log_prob = self.samplers[seq_id].pick(logits[None])
            if log_prob is not None:
                answer.log_probs[seq_id] = log_prob
        return answer

    def _load_blocks(self, message: StepMessage, caches: list[KVCache]) -> None:
        """Each prompt's cached first blocks the head named, into its empty slot, before
        any block of this step is kept (the first caches are the prompts')."""
        for seq_id, cache in zip(message.prompt_seq_ids, caches, strict=False):
            if seq_id in message.cached_blocks:
                self._pool().load(message.cached_blocks[seq_id], cache)

    def _keep_blocks(self, message: StepMessage, caches: list[KVCache]) -> None:
        """Keep the new whole blocks the head named of each prompt whose last chunk ran."""
        for seq_id, cache in zip(message.prompt_seq_ids, caches, strict=False):
            for block, index in message.store_blocks.get(seq_id, []):
                self._pool().write(index, block, cache)

    def _pool(self) -> BlockPool:
        if self.blocks is None:
            raise RuntimeError("told to load or keep prefix blocks, but this stage keeps none")
        return self.blocks

    def _compute(
        self, message: StepMessage, caches: list[KVCache]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Colocated prompts, then the token step; the busy interval goes on the timeline."""
        start = time.monotonic()
        n = len(message.prompts)
        inputs = message.inputs if message.seq_ids else None
        prompt_out, step_out = self.engine.step(message.prompts, caches[:n], inputs, caches[n:])
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # so the interval is the compute
        kind = "+".join(k for k, ran in (("prefill", n), ("decode", message.seq_ids)) if ran)
        self.timeline.append(Interval(start, time.monotonic(), message.microbatch, kind))
        return prompt_out, step_out

    def _next_microbatch(self, mb: int) -> int:
        """Microbatches circulate in the order the head first issued them: predict from the
        order seen last round, else the next id that has sequences."""
        if self._previous is not None:
            self._followed_by[self._previous] = mb
        self._previous = mb
        seen = self._followed_by.get(mb)
        if seen is not None and self.members.get(seen):
            return seen
        for offset in range(1, self.num_microbatches + 1):
            following = (mb + offset) % self.num_microbatches
            if self.members.get(following):
                return following
        return mb

    def _forget(self, seq_ids: list[int]) -> None:
        """Free ended sequences; after a failed step some may never have arrived here."""
        for seq_id in seq_ids:
            if seq_id in self.kv:
                self.kv.drop(seq_id)
            if self.prompt_kv is not None:  # its request id, or its prompt KV if admitted in
                self.prompt_kv.discard(seq_id)  # a step that failed before taking it
            self.samplers.pop(seq_id, None)
            if self.on_release is not None:
                self.on_release(seq_id)
