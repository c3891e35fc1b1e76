"""Microbatch scheduling with early-stop refill (DejaVu's modified FasterTransformer baseline).

``num_microbatches`` microbatches circulate through the pipeline, each holding
up to ``batch_size`` sequences. When a sequence stops early (eos or its own
``max_tokens``) its slot is refilled from the waiting queue at that
microbatch's next step, and the stages free its KV before computing that step.

Colocated, a new sequence's prompt runs in the same microbatch step as the
others' token step (the bubbles disaggregation removes); disaggregated, the
waiting queue holds only sequences whose prompt KV is already on the stages,
and they join the token step at once.

Steps are numbered per microbatch and never restart, refills included, so a
(microbatch, step) pair names one step for good: fault tolerance acks
replicas by it. Only :meth:`rewind` (recovery) goes back, to redo steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.pipeline.sequence import FinishReason, Sequence, Status


@dataclass
class Batch:
    """One microbatch step as the head sends it down the pipeline."""

    microbatch: int
    step: int
    decode: list[Sequence] = field(default_factory=list)  # one token step, in this order
    prefill: list[Sequence] = field(default_factory=list)  # colocated: prompts run this step
    admit: list[Sequence] = field(default_factory=list)  # disaggregated: joining (also in decode)
    release: list[int] = field(default_factory=list)  # seq ids whose KV is freed first

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.prefill or self.release)


class MicrobatchScheduler:
    def __init__(self, num_microbatches: int, batch_size: int, colocated: bool) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.colocated = colocated
        self.waiting: deque[Sequence] = deque()
        self.running: list[list[Sequence]] = [[] for _ in range(num_microbatches)]
        self.to_release: list[list[int]] = [[] for _ in range(num_microbatches)]
        self.steps = [0] * num_microbatches
        self.joined: dict[int, int] = {}  # seq id -> step it joined its microbatch at

    def add(self, seq: Sequence) -> None:
        """Queue a sequence: a prompt (colocated) or one whose prompt KV is in place."""
        self.waiting.append(seq)

    def schedule(self, microbatch: int) -> Batch:
        """The next step of ``microbatch``: its running sequences plus refills."""
        running = self.running[microbatch]
        new: list[Sequence] = []
        while self.waiting and len(running) + len(new) < self.batch_size:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            new.append(seq)
            self.joined[seq.seq_id] = self.steps[microbatch]
        batch = Batch(microbatch, self.steps[microbatch], release=self.to_release[microbatch])
        if self.colocated:
            batch.decode, batch.prefill = list(running), new
        else:
            batch.decode, batch.admit = running + new, new
        self.running[microbatch] = running + new
        self.to_release[microbatch] = []
        if not batch.is_empty:
            self.steps[microbatch] += 1
        return batch

    def postprocess(self, microbatch: int, tokens: dict[int, int],
                    log_probs: dict[int, TokenLogProb] | None = None,
                    cached: dict[int, int] | None = None) -> list[Sequence]:
        """Record one step's tokens (and the log-probs of those that asked, the cached
        tokens of the prompts that ran); returns the sequences that ended (their KV is
        freed next)."""
        ended = []
        log_probs, cached = log_probs or {}, cached or {}
        for seq in self.running[microbatch]:
            if seq.seq_id in cached:
                seq.cached_tokens = cached[seq.seq_id]
            if not seq.is_finished:  # cancelled while in flight: its token is dropped
                seq.append(tokens[seq.seq_id], log_probs.get(seq.seq_id))
            if seq.is_finished:
                ended.append(seq)
        self._retire(microbatch, ended)
        return ended

    def fail(self, microbatch: int, error: str) -> list[Sequence]:
        """A step failed on some stage: end its sequences with the error, free their KV."""
        ended = list(self.running[microbatch])
        for seq in ended:
            seq.finish(FinishReason.ERROR, error)
        self._retire(microbatch, ended)
        return ended

    def rewind(self, microbatch: int, step: int) -> tuple[dict[int, int], list[Sequence]]:
        """Fault recovery: ``microbatch`` redoes from ``step``; its tokens from then on go.

        Returns each remaining sequence's KV length before ``step`` and the sequences
        that joined at ``step`` or later, reset to start over from their prompt (they
        are out of the microbatch; the caller queues them again)."""
        lengths: dict[int, int] = {}
        restarted: list[Sequence] = []
        for seq in self.running[microbatch]:
            done = step - self.joined[seq.seq_id]  # steps it took before ``step``
            if done <= 0:
                restarted.append(seq)
                continue
            # Colocated, its first step was the prefill; disaggregated, the first token
            # came with the prompt KV and every step here added one.
            keep = done if self.colocated else done + 1
            seq.truncate(keep)
            lengths[seq.seq_id] = seq.prompt_len + keep - 1
        for seq in restarted:
            self.running[microbatch].remove(seq)
            del self.joined[seq.seq_id]
            seq.truncate(0)
            seq.status = Status.WAITING
        self.steps[microbatch] = step
        return lengths, restarted

    def clear(self) -> None:
        """Forget every sequence (the pipeline is down or stopped; they were ended)."""
        self.joined.clear()
        self.waiting.clear()
        self.running = [[] for _ in self.running]
        self.to_release = [[] for _ in self.to_release]

    def cancel(self, request_id: str) -> Sequence | None:
        """End a request; a running one keeps its slot until its microbatch comes back."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish(FinishReason.CANCELLED)
                return seq
        for running in self.running:
            for seq in running:
                if seq.request_id == request_id and not seq.is_finished:
                    seq.finish(FinishReason.CANCELLED)
                    return seq
        return None

    def _retire(self, microbatch: int, ended: list[Sequence]) -> None:
        gone = {id(s) for s in ended}
        for seq in ended:
            self.joined.pop(seq.seq_id, None)
        self.running[microbatch] = [s for s in self.running[microbatch] if id(s) not in gone]
        self.to_release[microbatch].extend(s.seq_id for s in ended)
