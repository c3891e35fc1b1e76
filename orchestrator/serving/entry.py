"""The frontend's entry points: batched requests served through the Frontend library.

Two models of the frontend node serve requests this way, each on a thread of its own:

- ``orchestrator``, the ensemble's second step: token ids that preprocessing made and
  signed in; token ids and their text out.
- ``tensorrt_llm_bls``: the ensemble's whole contract, text in and text out, with the
  preprocessing code (:mod:`orchestrator.serving.text`) called in-process too. Triton
  2.51's ensemble hands a client's cancellation on only between steps, so a decoupled
  step (the orchestrator) runs to ``max_tokens`` after the client left; a model that runs
  the whole request itself sees ``is_cancelled()``, and :meth:`Frontend.generate` then
  cancels its stream to the T-node, which frees the slot.

A request is split into its sequences and every row is checked before any node works on
it (:func:`orchestrator.serving.batch.split`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from orchestrator.serving.batch import BatchReply, Send, SendError, SequenceJob, split
from orchestrator.serving.config import NodeConfig
from orchestrator.serving.frontend import FRONTEND_TIMEOUT_S, Frontend
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.node_stream import Cancelled
from orchestrator.serving.params import GenerationParams, RequestError, check_prompt

# (the row's prompt ids, its input_auth or None): raises unless the row may be served
Verify = Callable[[list[int], str | None], None]


@dataclass(frozen=True)
class Replies:
    """How one request answers: ``send`` a sequence's response, ``error`` a failure
    (message, is it the request's last response), ``refuse`` the request itself (a client
    error, its only response), ``close`` it with the final flag alone (cancelled)."""

    send: Send
    error: SendError
    refuse: Callable[[str], None]
    close: Callable[[], None]


class EntryPoint:
    """Serves a model's requests: at most ``max_requests`` at once, each split into its
    sequences and generated through ``frontend``; counts them (``dejavu_queue_length``,
    ``dejavu_requests`` by outcome)."""

    def __init__(self, frontend: Frontend, limits: RequestLimits, metrics: Metrics,
                 max_requests: int) -> None:
        self.frontend, self.limits, self.metrics = frontend, limits, metrics
        self.pool = ThreadPoolExecutor(max_workers=max_requests)
        self.held, self.lock = 0, threading.Lock()

    @classmethod
    def for_node(cls, config: NodeConfig, metrics: Metrics,
                 tokenizer: Tokenizer | None = None) -> EntryPoint:
        """From the frontend's configuration; with ``tokenizer`` the prompt byte limit is
        its (:meth:`RequestLimits.for_node`)."""
        frontend = Frontend(list(config.prefill_urls), [list(p) for p in config.decode_urls],
                            config.secret(), controller=config.controller, metrics=metrics,
                            max_sequences=config.max_sequences(),
                            pipeline_sequences=config.pipeline_sequences(),
                            timeout_s=FRONTEND_TIMEOUT_S * config.time_scale,
                            stream_interval=config.stream_interval,
                            router=config.router, kv_weight=config.kv_weight,
                            kv_block=config.kv_block, decode_reuse=config.decode_cache_mb > 0)
        return cls(frontend, RequestLimits.for_node(config, tokenizer), metrics,
                   config.concurrent_requests())

    def submit(self, jobs: Callable[[], list[SequenceJob]], replies: Replies,
               is_cancelled: Callable[[], bool]) -> None:
        """Serve a request on the pool; ``jobs`` reads and checks it there (RequestError:
        refused)."""
        self.pool.submit(self.serve, jobs, replies, is_cancelled, time.time_ns())

    def serve(self, jobs: Callable[[], list[SequenceJob]], replies: Replies,
              is_cancelled: Callable[[], bool], arrival_ns: int) -> None:
        self._count(+1)
        outcome = "failed"
        try:
            # Everything a client can get wrong is refused here, before any node works.
            reply = BatchReply(jobs(), replies.send, replies.error, replies.close,
                               self.frontend.kv_block, arrival_ns)
            reply.run(self.frontend.generate, is_cancelled)
            outcome = "finished"
        except Cancelled:  # the client left; the final flag went out (BatchReply)
            outcome = "cancelled"
        except RequestError as exc:
            outcome = "refused"
            replies.refuse(str(exc))
        except Exception as exc:
            replies.error(str(exc), True)
        finally:
            self._count(-1)
            self.metrics.request_done(outcome)

    def split(self, tensors: Mapping[str, np.ndarray | None],
              verify: Verify | None = None) -> list[SequenceJob]:
        """Every sequence of a batched request of token ids (``input_ids``,
        ``input_lengths``, the parameters); each row must fit the context and pass
        ``verify``, and all of them the cluster at once (else none could wait for the
        others' seats)."""

        def check(ids: np.ndarray, signature: str | None, params: GenerationParams) -> None:
            prompt = self.limits.check_ids(ids)
            if verify is not None:
                verify(prompt, signature)
            check_prompt(prompt, params, self.limits.max_seq_len, self.limits.vocab_size)

        jobs = split(tensors, check)
        most = self.frontend.max_sequences
        if most and len(jobs) > most:
            raise RequestError(f"{len(jobs)} sequences (rows x num_return_sequences): the "
                               f"cluster holds at most {most} at once")
        return jobs

    def _count(self, change: int) -> None:
        with self.lock:
            self.held += change
            self.metrics.queue_length(self.held)

    def close(self) -> None:
        self.frontend.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
