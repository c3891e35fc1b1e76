"""What flows between pipeline stages, and the link it flows over.

Stage ``i`` sends each microbatch step to stage ``i + 1``; the last stage sends
the step's tokens back to the head. A :class:`KVProbe` asks every stage whether
the prompt KV of requests prefilled elsewhere has landed: it rides on a step
(each stage answers it after its layers, the last in the step's tokens), or
takes the same path alone while no step is in flight. In one process a
:class:`QueueLink` (bounded, so a slow stage back-pressures the one before it);
across processes the same messages go over a transport behind the same two calls
(:mod:`orchestrator.pipeline.transport_link`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.sampling import SamplingParams


@dataclass
class KVProbe:
    """Has the prompt KV of these requests landed on every stage? (prefilled elsewhere)

    Each stage keeps in ``requests`` only those whose KV it holds complete and
    moves the others to ``failed`` or ``waiting_at``; the last stage answers
    with each complete request's first token (the prompt worker's ``extra``).
    """

    requests: dict[int, str]  # seq id -> request id (the KV receivers' key)
    release: dict[int, str] = field(default_factory=dict)  # drop these (never admitted)
    ready: dict[int, int] = field(default_factory=dict)  # seq id -> first token
    failed: dict[int, str] = field(default_factory=dict)  # seq id -> error naming the stage
    waiting_at: dict[int, int] = field(default_factory=dict)  # seq id -> first stage lacking it


@dataclass
class StepMessage:
    """One microbatch step on its way down the pipeline."""

    microbatch: int
    step: int
    seq_ids: list[int]  # rows of ``inputs``: sequences taking a token step
    inputs: torch.Tensor | None  # [B] token ids (first stage) or [B, hidden]
    prompt_seq_ids: list[int] = field(default_factory=list)  # colocated: prompts to run
    prompts: list[torch.Tensor] = field(default_factory=list)  # [T] ids or [T, hidden] each
    # Colocated chunked prefill: prompt_seq_ids whose chunk is not their prompt's last (their
    # KV grows, no token is sampled); the others' chunks end their prompts.
    partial: list[int] = field(default_factory=list)
    admit: list[int] = field(default_factory=list)  # prompt KV waits in each stage's inbox
    # Admitted sequences whose KV the stages already hold (re-attached after a lost head):
    # seq id -> the KV length kept, the rest cut; no prompt KV is taken for them.
    resume: dict[int, int] = field(default_factory=dict)
    release: list[int] = field(default_factory=list)  # free these sequences' KV first
    sampling: dict[int, SamplingParams] = field(default_factory=dict)  # sampling from here on
    error: str | None = None  # an earlier stage failed this step; pass it on
    # Colocated with a prefix cache (its index on the head, each stage's layers in its block
    # pool): prompt seq id -> the pool indices of its first blocks, loaded into its empty
    # slot before its first chunk runs (the chunk starts after them) ...
    cached_blocks: dict[int, list[int]] = field(default_factory=dict)
    # ... and -> (block of its prompt, pool index) to keep after its last chunk ran.
    store_blocks: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    probe: KVProbe | None = None  # answered by each stage after its layers


@dataclass
class TokenMessage:
    """The last stage's answer for one microbatch step."""

    microbatch: int
    step: int
    tokens: dict[int, int]  # seq id -> new token
    error: str | None = None
    log_probs: dict[int, TokenLogProb] = field(default_factory=dict)  # those that asked
    probe: KVProbe | None = None  # the step's probe, answered by every stage


class Shutdown:
    """Sent through the pipeline to stop every stage in order."""


Message = StepMessage | TokenMessage | KVProbe | Shutdown


class LinkTimeout(TimeoutError):
    pass


class LinkError(ConnectionError):
    """The link's other end is gone (its process died or its transport failed)."""


class Link(Protocol):
    received: int  # messages ``recv`` has returned (a receiving end's)

    def send(self, message: Message, timeout_s: float) -> None:
        """Deliver or raise :class:`LinkTimeout`; never blocks past ``timeout_s``."""
        ...

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or ``None`` if none came within ``timeout_s`` or :meth:`wake`
        was called meanwhile."""
        ...

    def wake(self) -> None:
        """End the wait of a ``recv`` now (another thread has new work for the receiver)."""
        ...

    def waiting(self) -> bool:
        """A message has arrived that no ``recv`` has returned yet (any thread may ask)."""
        ...


class QueueLink:
    """In-process link: a bounded FIFO between two threads (a ``wake`` takes no room)."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self._messages: deque[Message] = deque()
        self._changed = threading.Condition()
        self._woken = False
        self.received = 0  # messages ``recv`` returned

    def send(self, message: Message, timeout_s: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._messages) < self.capacity,
                                          timeout_s):
                raise LinkTimeout(f"{self.name}: receiver took nothing for {timeout_s} s")
            self._messages.append(message)
            self._changed.notify_all()

    def recv(self, timeout_s: float) -> Message | None:
        with self._changed:
            self._changed.wait_for(lambda: self._messages or self._woken, timeout_s)
            self._woken = False
            if not self._messages:
                return None
            message = self._messages.popleft()
            self.received += 1
            self._changed.notify_all()  # room for a waiting sender
            return message

    def wake(self) -> None:
        with self._changed:
            self._woken = True
            self._changed.notify_all()

    def waiting(self) -> bool:
        with self._changed:
            return bool(self._messages)
