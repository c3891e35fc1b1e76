"""Microbatch scheduling with early-stop refill (DejaVu's modified FasterTransformer baseline).

``num_microbatches`` microbatches circulate through the pipeline, each holding
up to ``batch_size`` sequences. When a sequence stops early (eos or its own
``max_tokens``) its slot is refilled from the waiting queue at that
microbatch's next step, and the stages free its KV before computing that step.

Colocated, a new sequence's prompt runs in the same microbatch step as the
others' token step (the bubbles disaggregation removes); disaggregated, the
waiting queue holds only sequences whose prompt KV is already on the stages,
and they join the token step at once.

Chunked prefill (colocated, ``prefill_chunk`` > 0: Sarathi-Serve's stall-free
batching, as vLLM's ``max_num_batched_tokens``): a step carries every running
sequence's token step, then prompt chunks while the step's tokens stay within
the budget: first the prompts this microbatch already started (in the order
they joined), then new ones. Token steps are never held back: a step of more
running sequences than the budget carries no chunk. A prompt's chunks run on
top of the KV its earlier chunks left (``Engine.prefill`` on a filled slot); it
samples its first token in the step of its last chunk. With a prefix cache
(``prefix``, the index of the blocks the stages keep), a prompt's first chunk
starts after its leading cached blocks, which the stages load with that step:
the budget pays only for the positions it computes. Its last chunk's step has
the stages keep its new whole blocks (:class:`~orchestrator.pipeline.prefix.PipelinePrefix`).

Steps are numbered per microbatch and never restart, refills included, so a
(microbatch, step) pair names one step for good: fault tolerance acks
replicas by it. Only :meth:`rewind` (recovery) goes back, to redo steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.pipeline import check_prefill_chunk
from orchestrator.pipeline.prefix import PipelinePrefix
from orchestrator.pipeline.sequence import FinishReason, Sequence, Status


@dataclass
class Chunk:
    """Prompt positions ``start:end`` of ``seq``, run in one step (colocated)."""

    seq: Sequence
    start: int
    end: int
    # With a prefix cache: a first chunk's cached blocks (pool indices), loaded first ...
    load: list[int] = field(default_factory=list)
    # ... and a last chunk's new whole blocks, (block, pool index), kept after it ran.
    store: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """The positions it computes (as scheduled)."""
        return self.end - self.start

    @property
    def completes(self) -> bool:
        """The prompt's last chunk: the step samples its first token."""
        return self.end == self.seq.prompt_len

    @property
    def ids(self) -> list[int]:
        return self.seq.prompt_ids[self.start:self.end]


@dataclass
class Batch:
    """One microbatch step as the head sends it down the pipeline."""

    microbatch: int
    step: int
    decode: list[Sequence] = field(default_factory=list)  # one token step, in this order
    prefill: list[Chunk] = field(default_factory=list)  # colocated: prompt chunks run this step
    admit: list[Sequence] = field(default_factory=list)  # disaggregated: joining (also in decode)
    release: list[int] = field(default_factory=list)  # seq ids whose KV is freed first

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.prefill or self.release)


class MicrobatchScheduler:
    def __init__(self, num_microbatches: int, batch_size: int, colocated: bool,
                 prefill_chunk: int = 0) -> None:
        """``prefill_chunk``: the token budget of a colocated step (token steps plus prompt
        chunks); 0: whole prompts."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_prefill_chunk(prefill_chunk, batch_size)
        if prefill_chunk and not colocated:
            raise ValueError("prefill_chunk needs a colocated pipeline (its prompts run here)")
        self.batch_size = batch_size
        self.colocated = colocated
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[list[Sequence]] = [[] for _ in range(num_microbatches)]
        self.to_release: list[list[int]] = [[] for _ in range(num_microbatches)]
        self.steps = [0] * num_microbatches
        self.joined: dict[int, int] = {}  # seq id -> step it joined its microbatch at
        # Colocated: seq id -> (step, prompt tokens prefilled after it), one per chunk.
        self.chunks: dict[int, list[tuple[int, int]]] = {}
        # Colocated with a prefix cache (set by the head's node): the blocks' index.
        self.prefix: PipelinePrefix | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a sequence: a prompt (colocated) or one whose prompt KV is in place."""
        self.waiting.append(seq)

    def schedule(self, microbatch: int) -> Batch:
        """The next step of ``microbatch``: its running sequences plus refills."""
        if self.colocated:
            return self._schedule_colocated(microbatch)
        running = self.running[microbatch]
        new = self._refill(microbatch, len(running))
        batch = Batch(microbatch, self.steps[microbatch], release=self.to_release[microbatch])
        batch.decode, batch.admit = running + new, new
        return self._issued(batch, running + new)

    def _schedule_colocated(self, microbatch: int) -> Batch:
        # A prompt cancelled before its last chunk takes no more steps: free it now.
        self._retire(microbatch, [s for s in self.running[microbatch]
                                  if s.is_finished and s.is_prefilling])
        running = self.running[microbatch]
        batch = Batch(microbatch, self.steps[microbatch], release=self.to_release[microbatch])
        batch.decode = [s for s in running if not s.is_prefilling]
        budget = self.prefill_chunk - len(batch.decode) if self.prefill_chunk else None
        for seq in running:  # prompts started in earlier steps go on first
            if seq.is_prefilling and (budget is None or budget > 0):
                batch.prefill.append(self._chunk(seq, budget, batch))
                budget = None if budget is None else budget - batch.prefill[-1].tokens
        new: list[Sequence] = []
        while budget is None or budget > 0:
            joined = self._refill(microbatch, len(running) + len(new), limit=1)
            if not joined:
                break
            new += joined
            batch.prefill.append(self._chunk(joined[0], budget, batch))
            budget = None if budget is None else budget - batch.prefill[-1].tokens
        return self._issued(batch, running + new)

    def _refill(self, microbatch: int, holding: int, limit: int | None = None
                ) -> list[Sequence]:
        """Waiting sequences that join ``microbatch`` (holding ``holding``) now."""
        new: list[Sequence] = []
        while (self.waiting and holding + len(new) < self.batch_size
               and (limit is None or len(new) < limit)):
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            new.append(seq)
            # Disaggregated, it joins with its first token (a re-attached one with more,
            # their KV but the last one's held): counted as if it had joined that much earlier.
            self.joined[seq.seq_id] = self.steps[microbatch] - (
                0 if self.colocated else len(seq.output_ids) - 1)
        return new

    def _chunk(self, seq: Sequence, budget: int | None, batch: Batch) -> Chunk:
        """The next ``budget`` prompt tokens of ``seq`` (None: the rest), run in ``batch``."""
        load: list[int] = []
        if seq.seq_id not in self.chunks and self.prefix is not None:  # its first
            load = self.prefix.hit(seq.prompt_ids, seq.cache_salt)
            seq.prefilled = seq.cached_tokens = len(load) * self.prefix.block_tokens
        left = seq.prompt_len - seq.prefilled
        chunk = Chunk(seq, seq.prefilled, seq.prefilled + min(left, budget or left), load)
        seq.prefilled = chunk.end
        if chunk.completes and self.prefix is not None:
            chunk.store = self.prefix.store(batch.microbatch, seq.prompt_ids, seq.cache_salt)
        self.chunks.setdefault(seq.seq_id, []).append((batch.step, chunk.end))
        return chunk

    def _issued(self, batch: Batch, running: list[Sequence]) -> Batch:
        self.running[batch.microbatch] = running
        self.to_release[batch.microbatch] = []
        if not batch.is_empty:
            self.steps[batch.microbatch] += 1
        return batch

    def postprocess(self, microbatch: int, tokens: dict[int, int],
                    log_probs: dict[int, TokenLogProb] | None = None) -> list[Sequence]:
        """Record one step's tokens (and the log-probs of those that asked); returns the
        sequences that ended (their KV is freed next)."""
        if self.prefix is not None:
            self.prefix.answered(microbatch)
        ended = []
        log_probs = log_probs or {}
        for seq in self.running[microbatch]:
            if self.colocated and seq.is_prefilling and not seq.is_finished:
                continue  # a prompt chunk that is not its last: no token yet
            if not seq.is_finished:  # cancelled while in flight: its token is dropped
                seq.append(tokens[seq.seq_id], log_probs.get(seq.seq_id))
            if seq.is_finished:
                ended.append(seq)
        self._retire(microbatch, ended)
        return ended

    def fail(self, microbatch: int, error: str) -> list[Sequence]:
        """A step failed on some stage: end its sequences with the error, free their KV."""
        if self.prefix is not None:
            self.prefix.failed(microbatch)
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
            kept = self._kept(seq, step)
            if kept is None:
                restarted.append(seq)
                continue
            keep, lengths[seq.seq_id] = kept
            seq.truncate(keep)
        for seq in restarted:
            self.running[microbatch].remove(seq)
            del self.joined[seq.seq_id]
            self.chunks.pop(seq.seq_id, None)
            seq.truncate(0)
            seq.prefilled = 0
            seq.status = Status.WAITING
        self.steps[microbatch] = step
        return lengths, restarted

    def _kept(self, seq: Sequence, step: int) -> tuple[int, int] | None:
        """What ``seq`` keeps when its microbatch redoes from ``step``: (tokens, KV length
        before ``step``); None when it had run no step before (it starts over)."""
        if not self.colocated:
            done = step - self.joined[seq.seq_id]  # the first token came with the prompt KV
            return None if done <= 0 else (done + 1, seq.prompt_len + done)
        chunks = self.chunks[seq.seq_id]
        while chunks and chunks[-1][0] >= step:
            chunks.pop()
        if not chunks:
            return None
        seq.prefilled = chunks[-1][1]
        if seq.is_prefilling:  # mid-prompt: its next chunk starts where the last one ended
            return 0, seq.prefilled
        keep = step - chunks[-1][0]  # the last chunk's step made the first token
        return keep, seq.prompt_len + keep - 1

    def clear(self) -> None:
        """Forget every sequence (the pipeline is down or stopped; they were ended)."""
        if self.prefix is not None:
            self.prefix.reset()
        self.joined.clear()
        self.chunks.clear()
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
            self.chunks.pop(seq.seq_id, None)
        self.running[microbatch] = [s for s in self.running[microbatch] if id(s) not in gone]
        self.to_release[microbatch].extend(s.seq_id for s in ended)
