"""Per-request state in a token pipeline: what was asked, what came out, why it ended."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.sampling import SamplingParams

# (sequence, new token or None for an ending without one, finished?)
TokenCallback = Callable[["Sequence", int | None, bool], None]

_ids = itertools.count()


def ids_after(seq_id: int) -> None:
    """New sequences of this process take ids above ``seq_id`` (a head that took over a lost
    one's sequences keeps their ids: every stage's KV is keyed by them)."""
    global _ids
    _ids = itertools.count(max(next(_ids), seq_id + 1))


class Status(enum.Enum):
    WAITING = "waiting"  # queued; colocated: prompt not run yet, disaggregated: KV pending
    READY = "ready"  # disaggregated: prompt KV is on the token stages, first token known
    RUNNING = "running"  # holds a slot of a microbatch
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP = "stop"  # the output ends with one of the request's stop words
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    eos_id: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    on_token: TokenCallback | None = None
    stop_words: tuple[tuple[int, ...], ...] = ()  # token sequences that end it, kept
    cache_salt: str = ""  # its prompt shares cached KV only with prompts under this salt
    cached_tokens: int = 0  # colocated: its prompt's tokens the stage's prefix cache held
    # Pipeline-internal id: small, unique, used as the key of every stage's KV.
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    # Aligned with output_ids when the sampling asks for log-probs (None: made elsewhere,
    # e.g. the P-node's first token, whose log-prob the client got from the P-node).
    log_probs: list[TokenLogProb | None] = field(default_factory=list)
    status: Status = Status.WAITING
    # Colocated: prompt tokens whose KV the stages hold or compute in the step in flight
    # (a chunked prompt runs over several steps; it samples once this reaches prompt_len).
    prefilled: int = 0
    # Re-attached to a new head: the KV length every stage keeps for it when it joins.
    kv_kept: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # monotonic seconds, for latency
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1, "
                             f"got {self.max_tokens}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        """Colocated: part of the prompt has not been scheduled yet."""
        return self.prefilled < self.prompt_len

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, log_prob: TokenLogProb | None = None) -> None:
        """Record one generated token; ends the sequence on eos, a stop word or max_tokens
        (early stop)."""
        self.output_ids.append(token)
        if self.sampling.log_probs:
            self.log_probs.append(log_prob)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if token == self.eos_id:
            self.finish_reason = FinishReason.EOS
        elif any(tuple(self.output_ids[-len(w):]) == tuple(w) for w in self.stop_words):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            self.status, self.finish_time = Status.FINISHED, time.monotonic()
        if self.on_token is not None:
            self.on_token(self, token, self.is_finished)

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` tokens (a recovery redoes the rest)."""
        del self.output_ids[keep:], self.log_probs[keep:]

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End without a new token (cancel, error); the callback hears it once."""
        if self.is_finished:
            return
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finish_time = time.monotonic()
        if self.on_token is not None:
            self.on_token(self, None, True)
