"""The T-node's token loop: one microbatch of in-flight requests, one step at a time.

Requests join between steps, either with their KV already streamed in by a
P-node (disaggregated) or as a bare prompt the loop prefills itself
(colocated). Each step feeds every request its last token, samples one more,
hands it to the request's ``emit`` at once, and drops the requests that hit
``max_tokens`` or ``end_id``, errored or were cancelled, freeing their KV.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.sampling import Sampler
from orchestrator.kv.layout import KVCache
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams

log = logging.getLogger(__name__)
CANCELLED = "request cancelled"


@dataclass(eq=False)
class DecodeRequest:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    emit: Callable[[list[int], bool], None]  # new tokens, is this the last response
    fail: Callable[[str], None]  # final error response
    is_cancelled: Callable[[], bool]
    release: Callable[[], None] = lambda: None  # frees the KV slot
    cache: KVCache | None = None
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # how many of ``tokens`` the client has
    sampler: Sampler | None = None

    def finished(self) -> bool:
        last = self.tokens[-1] if self.tokens else None
        hit_end = self.params.end_id is not None and last == self.params.end_id
        return len(self.tokens) >= self.params.max_tokens or hit_end


class DecodeWorker:
    """Owns the engine on a T-node; all engine calls happen on its thread."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 16,
        metrics: Metrics | None = None,
        idle_wait_s: float = 0.01,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.reported_queue = 0
        self.max_batch = max_batch
        self.idle_wait_s = idle_wait_s
        self.active: list[DecodeRequest] = []
        # (request, None) wants prefill here; (request, future) waits for streamed KV
        self.arrivals: list[tuple[DecodeRequest, Future | None]] = []
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.thread.start()

    # -- admission (any thread) -------------------------------------------------

    def submit_prompt(self, request: DecodeRequest) -> None:
        """Colocated: the loop prefills the prompt itself."""
        self._arrive(request, None)

    def submit_streamed(self, request: DecodeRequest, kv: Future) -> None:
        """Disaggregated: ``kv`` resolves to ``(cache, first_token)`` once the P-node is done."""
        self._arrive(request, kv)

    def _arrive(self, request: DecodeRequest, kv: Future | None) -> None:
        with self.lock:
            self.arrivals.append((request, kv))
        self.wakeup.set()

    @property
    def queue_length(self) -> int:
        with self.lock:
            return len(self.active) + len(self.arrivals)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped.set()
        self.wakeup.set()
        self.thread.join(timeout_s)
        for request in self.active + [r for r, _ in self.arrivals]:
            self._end(request, error="decode node shutting down")

    # -- the loop (its own thread) ----------------------------------------------

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self._admit()
                self._drop_cancelled()
                self._report_queue()
                if self.active:
                    self._step()
                else:
                    self.wakeup.wait(self.idle_wait_s)
                    self.wakeup.clear()
            except Exception as exc:  # keep serving: fail this batch, not the node
                log.exception("decode step failed")
                for request in self.active:
                    self._end(request, error=f"decode step failed: {exc}")
                self.active = []

    def _admit(self) -> None:
        room = self.max_batch - len(self.active)
        to_prefill: list[DecodeRequest] = []
        with self.lock:
            waiting = []
            for request, kv in self.arrivals:
                if request.is_cancelled():
                    self._end(request, error=CANCELLED)
                    continue
                if room <= 0 or (kv is not None and not kv.done()):
                    waiting.append((request, kv))
                    continue
                room -= 1
                if kv is None:
                    to_prefill.append(request)
                else:
                    self._take_streamed(request, kv)
            self.arrivals = waiting
        if to_prefill:
            self._prefill(to_prefill)

    def _take_streamed(self, request: DecodeRequest, kv: Future) -> None:
        try:
            request.cache, first_token = kv.result()
        except Exception as exc:
            self._end(request, error=f"KV transfer failed: {exc}")
            return
        # The P-node already sent the first token to the client: count it, don't emit it.
        request.tokens.append(first_token)
        request.sent = 1
        request.sampler = request.params.make_sampler(offset=1)
        if request.finished():
            self._end(request)
        else:
            self.active.append(request)

    def _prefill(self, requests: list[DecodeRequest]) -> None:
        caches = [self.engine.new_cache() for _ in requests]
        prompts = [torch.tensor(r.prompt_ids, dtype=torch.long) for r in requests]
        logits = self.engine.prefill(prompts, caches)
        for request, cache, row in zip(requests, caches, logits, strict=True):
            request.cache = cache
            request.sampler = request.params.make_sampler()
            self._append(request, int(request.sampler(row[None])[0]))
            if request.finished():
                self._end(request)
            else:
                self.active.append(request)

    def _drop_cancelled(self) -> None:
        keep = []
        for request in self.active:
            if request.is_cancelled():
                self._end(request, error=CANCELLED)
            else:
                keep.append(request)
        self.active = keep

    def _step(self) -> None:
        inputs = torch.tensor([r.tokens[-1] for r in self.active], dtype=torch.long)
        logits = self.engine.decode(inputs, [r.cache for r in self.active])
        keep = []
        for request, row in zip(self.active, logits, strict=True):
            self._append(request, int(request.sampler(row[None])[0]))
            if request.finished():
                self._end(request)
            else:
                keep.append(request)
        self.active = keep

    def _append(self, request: DecodeRequest, token: int) -> None:
        request.tokens.append(token)
        if not request.finished():  # the last token goes out with the final flag
            request.emit([token], False)
            request.sent = len(request.tokens)

    def _report_queue(self) -> None:
        held = self.queue_length
        if held != self.reported_queue:
            self.metrics.queue_length(held)
            self.reported_queue = held

    def _end(self, request: DecodeRequest, error: str | None = None) -> None:
        """Send the last response exactly once and free the slot."""
        outcome = "finished" if error is None else "cancelled" if error == CANCELLED else "failed"
        self.metrics.request_done(outcome)
        try:
            if outcome == "cancelled":
                pass  # Triton closed the response stream when is_cancelled() said so
            elif error is not None:
                request.fail(error)
            else:
                request.emit(request.tokens[request.sent :], True)
        except Exception:
            log.exception("could not send the last response of %s", request.request_id)
        finally:
            try:
                request.release()
            except Exception:
                log.exception("could not release the KV of %s", request.request_id)

