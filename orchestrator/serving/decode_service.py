"""Admission on a T-node: check a request, reserve its KV slot, hand it to the token loop.

Disaggregated: reserve a slot in the KV receiver's pool, answer with the ticket
(the P-node writes there), then wait for the KV off the loop's thread.
Colocated: the loop prefills the prompt itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from orchestrator.engine.base import Engine
from orchestrator.serving.decode_worker import DecodeRequest, DecodeWorker
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams, check_prompt
from orchestrator.serving.prefill_worker import decode_token


class DecodeService:
    def __init__(
        self,
        engine: Engine,
        receiver=None,  # orchestrator.kv.connector.KVReceiver; None: colocated
        max_batch: int = 16,
        kv_timeout_s: float = 30.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.kv_timeout_s = kv_timeout_s
        self.metrics = metrics or Metrics()
        self.worker = DecodeWorker(engine, max_batch, self.metrics)
        # KVReceiver.wait blocks; the loop must not, so waits run here.
        self.waits = ThreadPoolExecutor(max_workers=max_batch, thread_name_prefix="kv-wait")

    @property
    def colocated(self) -> bool:
        return self.receiver is None

    def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: GenerationParams,
        emit: Callable[[list[int], bool], None],
        fail: Callable[[str], None],
        is_cancelled: Callable[[], bool],
        send_ticket: Callable[[bytes], None],
    ) -> None:
        """Raises RequestError (nothing reserved) if the request cannot be served."""
        check_prompt(prompt_ids, params, self.engine.kv_layout.max_seq_len, self.engine.vocab_size)
        request = DecodeRequest(request_id, prompt_ids, params, emit, fail, is_cancelled)
        if self.receiver is None:
            self.worker.submit_prompt(request)
            return
        ticket = self.receiver.reserve(request_id, len(prompt_ids))
        request.release = lambda: self.receiver.release(request_id)
        try:
            send_ticket(ticket)
        except Exception:
            request.release()
            raise
        kv = self.waits.submit(self._wait_kv, request_id, time.perf_counter())
        self.worker.submit_streamed(request, kv)

    def _wait_kv(self, request_id: str, reserved_at: float):
        cache, extra = self.receiver.wait(request_id, self.kv_timeout_s)
        layout = cache.layout
        nbytes = cache.length * layout.token_bytes_per_layer() * layout.num_layers
        self.metrics.kv_streamed(nbytes, time.perf_counter() - reserved_at)
        return cache, decode_token(extra)

    def stop(self) -> None:
        self.worker.stop()
        self.waits.shutdown(wait=False, cancel_futures=True)
