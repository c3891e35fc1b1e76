"""The P-node's job: prefill a batch of prompts, streaming each layer's KV as it is made.

The P-node runs the prompt pipeline's D_p stages in this one process
(:func:`~orchestrator.pipeline.prefill.stream_prefill`); each layer goes
to the token-pipeline stage that holds it (one ticket per T-stage) while the
next layer computes (DejaVu §4.1, Splitwise's layer-wise transfer), so
D_p != D_t regroups the KV on the way. The first token travels twice: back to
the caller, which streams it to the client at once, and as the transfer's
extra bytes, so the T-pipeline knows what to feed next.

A job whose client left (its ``is_cancelled``, asked at most every
``CANCEL_POLL_S``: each question is a round trip to tritonserver; or its first
token stage ended the request, which the P-node reads in that stage's KV slot,
:meth:`~orchestrator.kv.connector.KVSender.ended`) is not started, and a batch
whose every job left stops after the layer in progress;
either way the token stages hear that nothing more will be written into the
job's KV slots (a signed ABORT), so they reuse them at once. Every job's token
stages hear first that this node will write it (a signed CLAIM, before the job
waits for the engines): if this process ends, they free its slots as soon as the
fault controller says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from orchestrator.engine.base import Engine
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.kv.errors import KVTransferError
from orchestrator.pipeline.prefill import PrefillCancelled, stream_prefill
from orchestrator.pipeline.prefix import PrefixReuse
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams


class First(NamedTuple):
    token: int
    log_prob: TokenLogProb | None  # if the job asked for it
    cached_tokens: int  # of its prompt, found in the prefix cache (not computed)


CANCEL_POLL_S = 0.01  # how often a running prefill asks whether its clients left
_DRAIN_S = 1.0  # longest wait, after a prefill stopped early, for its transfers in flight


def _never() -> bool:
    return False


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    tickets: list[bytes]  # one per token stage, from each stage's KV receiver
    is_cancelled: Callable[[], bool] = _never  # has its client left?


class PrefillWorker:
    """Owns the prompt stages' engines and KV senders on a P-node; one batch at a time."""

    def __init__(
        self,
        engines: Sequence[Engine],
        senders: Sequence,  # orchestrator.kv.connector.KVSender, one per engine
        save_timeout_s: float = 30.0,
        metrics: Metrics | None = None,
        prefix: PrefixReuse | None = None,
    ) -> None:
        """``prefix``: the node's prefix cache (None: every prompt runs whole)."""
        self.engines, self.senders = list(engines), list(senders)
        self.prefix = prefix
        self.metrics = metrics or Metrics()
        self.save_timeout_s = save_timeout_s
        self.lock = threading.Lock()  # Triton may run execute() from several threads

    def run(self, jobs: Sequence[PrefillJob]) -> list[First | Exception]:
        """First token (and its log-prob if the job asked) per job, or the exception that
        job failed with."""
        for job in jobs:  # before waiting for the engines: a batch may run meanwhile
            self.senders[0].claim(job.request_id, job.tickets)
        with self.lock:
            self.metrics.held("prompts", len(jobs))
            try:
                results = self._run(jobs)
                if any(isinstance(result, PrefillCancelled) for result in results):
                    self._drain()  # so the gauge below reads what it keeps, not a moment
            finally:
                self.metrics.held("prompts", 0)
                self.metrics.held("staging_blocks", self.staging_in_flight())
        for result in results:
            self.metrics.request_done(
                "cancelled" if isinstance(result, PrefillCancelled)
                else "failed" if isinstance(result, Exception) else "finished")
        return results

    def kv_events(self, cursor: str) -> bytes | None:
        """Its prefix cache's KV events after a router's ``cursor``, signed (None: no
        cache)."""
        return None if self.prefix is None else self.prefix.events.answer(cursor)

    def staging_in_flight(self) -> int:
        """Staging blocks still taken (0 between batches once their transfers drained)."""
        return sum(sender.in_flight() for sender in self.senders)

    def _left(self, job: PrefillJob) -> bool:
        """Its client left: Triton says so (a client's own cancel), or the token stage ended
        the request (the frontend's signed ``end``: our nodes never cancel a gRPC call)."""
        return job.is_cancelled() or self.senders[0].ended(job.tickets[0])

    def _give_up(self, job: PrefillJob) -> None:
        for sender in self.senders:
            with contextlib.suppress(KVTransferError, ValueError):  # e.g. a bad ticket
                sender.give_up(job.request_id, job.tickets)

    def _drain(self) -> None:
        """Wait (at most ``_DRAIN_S``) for the layers a stopped prefill left in flight: a
        finished one waited for its saves already."""
        deadline = time.monotonic() + _DRAIN_S
        while self.staging_in_flight() and time.monotonic() < deadline:
            time.sleep(0.002)

    def _run(self, jobs: Sequence[PrefillJob]) -> list[First | Exception]:
        results: list[First | Exception] = [
            ValueError("empty prompt") if not job.prompt_ids
            else PrefillCancelled("cancelled before it started") for job in jobs]
        todo = {job.request_id: job for job in jobs if job.prompt_ids and not job.is_cancelled()}
        for job in jobs:
            if job.request_id not in todo:
                self._give_up(job)
        if not todo:
            return results
        opened = time.perf_counter()
        log_probs: dict[str, TokenLogProb] = {}
        cached: dict[str, int] = {}
        sent: dict[str, int] = {}
        ahead: dict[str, int] = {}
        try:
            first = stream_prefill(
                self.engines, self.senders,
                {rid: job.prompt_ids for rid, job in todo.items()},
                {rid: job.tickets for rid, job in todo.items()},
                {rid: job.params.sampling(job.prompt_ids) for rid, job in todo.items()},
                self.save_timeout_s,
                log_probs,
                _every(CANCEL_POLL_S, lambda: all(self._left(job) for job in todo.values())),
                self.prefix,
                {rid: job.params.cache_salt for rid, job in todo.items()},
                cached,
                sent,
                ahead,
            )
        except Exception as exc:  # one transfer failed (stream_prefill cannot tell which),
            # or every job's client left
            return [exc if job.request_id in todo else r
                    for job, r in zip(jobs, results, strict=True)]
        seconds = time.perf_counter() - opened
        for i, job in enumerate(jobs):
            if job.request_id in todo:
                results[i] = First(first[job.request_id], log_probs.get(job.request_id),
                                   cached.get(job.request_id, 0))
                self.metrics.kv_streamed(sent.get(job.request_id, 0), seconds,
                                         ahead.get(job.request_id, 0))
        if self.prefix is not None:
            self.metrics.prefix_cache(self.prefix.cache)
        return results


def _every(seconds: float, check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, asked at most every ``seconds`` (False in between)."""
    due = time.monotonic() + seconds

    def throttled() -> bool:
        nonlocal due
        if time.monotonic() < due:
            return False
        due = time.monotonic() + seconds
        return check()

    return throttled
