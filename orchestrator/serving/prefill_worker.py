"""The P-node's job: prefill a batch of prompts, streaming each layer's KV as it is made.

The engine's ``on_layer`` hook hands layer l to the KV sender while layer l+1
computes (DejaVu §4.1, Splitwise's layer-wise transfer). The first token
travels twice: back to the caller, which streams it to the client at once,
and as the transfer's extra bytes, so the T-node knows what to feed next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.engine.base import Engine
from orchestrator.kv.layout import KVCache
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams


def encode_token(token: int) -> bytes:
    return token.to_bytes(4, "little")


def decode_token(extra: bytes) -> int:
    if len(extra) != 4:
        raise ValueError(f"expected a 4-byte first token after the KV, got {len(extra)} bytes")
    return int.from_bytes(extra, "little")


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    ticket: bytes  # from the T-node's KVReceiver.reserve


class PrefillWorker:
    """Owns the engine and the KV sender on a P-node; one batch at a time."""

    def __init__(
        self,
        engine: Engine,
        sender,
        save_timeout_s: float = 30.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.sender = sender  # orchestrator.kv.connector.KVSender
        self.save_timeout_s = save_timeout_s
        self.lock = threading.Lock()  # Triton may run execute() from several threads

    def run(self, jobs: Sequence[PrefillJob]) -> list[int | Exception]:
        """First token per job, or the exception that job failed with."""
        with self.lock:
            results = self._run(jobs)
        for result in results:
            self.metrics.request_done("failed" if isinstance(result, Exception) else "finished")
        return results

    def _run(self, jobs: Sequence[PrefillJob]) -> list[int | Exception]:
        results: list[int | Exception] = [RuntimeError("not run")] * len(jobs)
        started = []  # (index, job, handle)
        for i, job in enumerate(jobs):
            try:
                if not job.prompt_ids:
                    raise ValueError("empty prompt")
                started.append((i, job, self.sender.start(job.request_id, [job.ticket])))
            except Exception as exc:
                results[i] = exc
        if not started:
            return results
        opened = time.perf_counter()
        caches = [self.engine.new_cache() for _ in started]
        handles = [handle for _, _, handle in started]

        def on_layer(layer: int, filled: Sequence[KVCache]) -> None:
            for handle, cache in zip(handles, filled, strict=True):
                self.sender.save_layer(handle, layer, cache)

        prompts = [torch.tensor(job.prompt_ids, dtype=torch.long) for _, job, _ in started]
        try:
            logits = self.engine.prefill(prompts, caches, on_layer=on_layer)
        except Exception as exc:
            for i, _, _ in started:
                results[i] = exc
            return results
        for (i, job, handle), row in zip(started, logits, strict=True):
            try:
                token = int(job.params.make_sampler()(row[None])[0])
                self.sender.finish(handle, extra=encode_token(token))
                self.sender.wait_for_save(handle, self.save_timeout_s)
                results[i] = token
                layout = self.engine.kv_layout
                nbytes = len(job.prompt_ids) * layout.token_bytes_per_layer() * layout.num_layers
                self.metrics.kv_streamed(nbytes, time.perf_counter() - opened)
            except Exception as exc:
                results[i] = exc
        return results
