"""A stage worker: one engine stage, its sequences' KV, one thread.

It takes microbatch steps from the previous stage's link, computes its layers
and sends the result on; the last stage samples and sends the tokens back to
the head. Torch ops release the GIL, so in one process the stages really do
overlap, and each stage's timeline of busy intervals shows where the bubbles
are.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.sampling import Sampler
from orchestrator.kv.layout import KVCache
from orchestrator.pipeline.link import Link, LinkTimeout, Shutdown, StepMessage, TokenMessage
from orchestrator.pipeline.swapper import KVPlacement

log = logging.getLogger(__name__)


class PromptKVSource(Protocol):
    """Where a token stage finds a prompt's KV that a prompt worker computed."""

    def take(self, seq_id: int, stage_index: int) -> KVCache: ...


@dataclass(frozen=True)
class Interval:
    """The stage computed ``microbatch`` from ``start`` to ``end`` (monotonic seconds)."""

    start: float
    end: float
    microbatch: int
    kind: str  # "decode", "prefill" or "prefill+decode"


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
    ) -> None:
        self.index, self.engine, self.kv = index, engine, kv
        self.inbox, self.outbox = inbox, outbox
        self.num_microbatches = num_microbatches
        self.prompt_kv = prompt_kv
        self.send_timeout_s, self.poll_s = send_timeout_s, poll_s
        self.is_last = engine.stage.is_last
        self.samplers: dict[int, Sampler] = {}  # last stage only
        self.members: dict[int, list[int]] = {}  # microbatch -> its sequences, as last seen
        self._followed_by: dict[int, int] = {}  # microbatch -> the one that came after it
        self._previous: int | None = None
        self.timeline: list[Interval] = []
        self.thread = threading.Thread(target=self._run, name=f"stage-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while True:
            message = self.inbox.recv(self.poll_s)
            if message is None:
                continue
            out = message if isinstance(message, Shutdown) else self._process_safely(message)
            try:
                self.outbox.send(out, self.send_timeout_s)
            except LinkTimeout:
                log.error("stage %d: next stage is not taking messages; stopping", self.index)
                return
            if isinstance(message, Shutdown):
                self.kv.shutdown()
                return

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
            if self.prompt_kv is None:
                raise RuntimeError("sequences admitted with prompt KV, but no prompt KV source")
            self.kv.add(seq_id, self.prompt_kv.take(seq_id, self.index))
        for seq_id in message.prompt_seq_ids:
            self.kv.add(seq_id, None)
        if self.is_last:
            self.samplers.update({s: Sampler(p) for s, p in message.sampling.items()})

        seq_ids = message.prompt_seq_ids + message.seq_ids
        caches = self.kv.open(mb, seq_ids) if seq_ids else []
        # While this microbatch computes, bring the next one's KV in (swapping only).
        following = self._next_microbatch(mb)
        self.kv.prefetch(following, self.members.get(following, []))

        prompt_out, step_out = self._compute(message, caches) if seq_ids else ([], None)
        self.kv.close(mb, seq_ids)
        self.members[mb] = seq_ids
        if not self.is_last:
            return replace(message, inputs=step_out, prompts=prompt_out)
        tokens = {s: self._sample(s, logits[None]) for s, logits in
                  zip(message.prompt_seq_ids, prompt_out, strict=True)}
        if step_out is not None:
            tokens |= {s: self._sample(s, row[None]) for s, row in
                       zip(message.seq_ids, step_out, strict=True)}
        return TokenMessage(mb, message.step, tokens)

    def _compute(
        self, message: StepMessage, caches: list[KVCache]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Colocated prompts, then the token step; the busy interval goes on the timeline."""
        start = time.monotonic()
        n = len(message.prompts)
        prompt_out = self.engine.prefill(message.prompts, caches[:n]) if n else []
        step_out = self.engine.decode(message.inputs, caches[n:]) if message.seq_ids else None
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

    def _sample(self, seq_id: int, logits: torch.Tensor) -> int:
        return int(self.samplers[seq_id](logits)[0])

    def _forget(self, seq_ids: list[int]) -> None:
        """Free ended sequences; after a failed step some may never have arrived here."""
        for seq_id in seq_ids:
            if seq_id in self.kv:
                self.kv.drop(seq_id)
            self.samplers.pop(seq_id, None)
