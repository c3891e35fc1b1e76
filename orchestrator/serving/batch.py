"""One batched request of the TensorRT-LLM contract, served as independent sequences.

A request holds ``batch`` rows (``[batch, 1]`` tensors); each row asks for
``num_return_sequences`` samples. Every (row, sample) is its own sequence, routed and
generated on its own; its responses carry ``batch_index`` and ``sequence_index`` so a
client tells them apart in a stream. The last response of the last sequence to end
carries the request's final flag.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.serving.frontend import NodeBusy, PipelineLost, PrefillLost
from orchestrator.serving.node_stream import Cancelled
from orchestrator.serving.outputs import kv_cache_use
from orchestrator.serving.params import GenerationParams, RequestError, as_text
from orchestrator.serving.router import UNAVAILABLE, NoNodeError
from orchestrator.serving.usage import RequestUsage

# (tokens, context tokens, meta, is this the request's last response); meta: batch_index,
# sequence_index, full_text (the text holds the prompt), cached_tokens, perf and log_probs
# (if asked)
Send = Callable[[list[int], list[int], dict, bool], None]
SendError = Callable[[str, bool], None]  # (message, is this the request's last response)
# (prompt, params, emit(tokens, log_probs, context, final), is_cancelled, usage); raises
# Cancelled
Generate = Callable[..., None]


@dataclass(frozen=True)
class SequenceJob:
    batch_index: int
    sequence_index: int
    prompt_ids: list[int]
    params: GenerationParams


# (prompt ids, the row's input_auth or None, its parameters): raises if it is refused
CheckRow = Callable[[np.ndarray, str | None, GenerationParams], None]


def split(tensors: Mapping[str, np.ndarray | None], check: CheckRow) -> list[SequenceJob]:
    """Every sequence of a batched request; raises RequestError (naming the row) if any
    row is refused by its parameters or by ``check``, before anything runs."""
    ids, lengths, auth = tensors["input_ids"], tensors["input_lengths"], tensors.get("input_auth")
    if ids is None or lengths is None or ids.ndim != 2:
        raise RequestError("input_ids must be [batch, tokens] with input_lengths [batch, 1]")
    jobs = []
    for row, length in enumerate(prompt_lengths(ids, lengths)):
        prompt = ids[row, :length]
        signature = None if auth is None else auth[row].reshape(-1)[0]
        try:
            params = GenerationParams.from_tensors(tensors, row)
            check(prompt, None if signature is None else as_text(signature), params)
        except RequestError as exc:
            raise RequestError(f"batch row {row}: {exc}" if ids.shape[0] > 1 else str(exc)
                               ) from None
        prompt = prompt.tolist()
        jobs += [SequenceJob(row, i, prompt, params.for_sequence(i))
                 for i in range(params.num_return_sequences)]
    return jobs


def prompt_lengths(ids: np.ndarray, lengths: np.ndarray) -> list[int]:
    """Each row's ``input_lengths``, checked against the ids sent: a row's prompt is its
    first ``length`` ids (the rest pad it to the longest row), so a length is in
    [0, width] and the longest row's is the width. Anything else is a client's bug, refused
    rather than served as another prompt."""
    width = ids.shape[1]
    if lengths.size != ids.shape[0] or lengths.dtype.kind not in "iu":
        raise RequestError(f"input_lengths must be [batch, 1] integers, one per row of "
                           f"input_ids ({ids.shape[0]} rows), got {lengths.dtype} "
                           f"{list(lengths.shape)}")
    found = [int(n) for n in lengths.reshape(-1)]
    for row, n in enumerate(found):
        # One row has no padding; several: the longest has none.
        if not 0 <= n <= width or (n != width and max(found) != width):
            where = f" (batch row {row})" if len(found) > 1 else ""
            raise RequestError(f"input_lengths {n}{where} is not the number of ids sent: "
                               f"input_ids has {width} a row"
                               + (", and the longest row none of padding" if where else ""))
    return found


class BatchReply:
    """Runs a request's sequences side by side and answers for each; counts the sequences
    still running so exactly one response carries the final flag."""

    def __init__(self, jobs: list[SequenceJob], send: Send, send_error: SendError,
                 close: Callable[[], None], kv_block: int = 32,
                 arrival_ns: int | None = None) -> None:
        """``close``: the final flag alone, for a request whose last sequence was cancelled;
        ``kv_block``: tokens per prefix-cache block, the unit of the perf metrics' KV
        fields."""
        self.jobs, self.send, self.send_error, self.close = jobs, send, send_error, close
        self.kv_block = kv_block
        self.arrival_ns = arrival_ns or time.time_ns()
        self.running = len(jobs)
        self.cancelled = False
        self.lock = threading.Lock()

    def run(self, generate: Generate, is_cancelled: Callable[[], bool]) -> None:
        """Every sequence, each on its own thread (the first on this one); returns when
        all have ended. Raises Cancelled if the client went away (nothing more is sent but
        the final flag)."""
        threads = [threading.Thread(target=self._serve, args=(job, generate, is_cancelled),
                                    name=f"sequence-{job.batch_index}-{job.sequence_index}",
                                    daemon=True) for job in self.jobs[1:]]
        for thread in threads:
            thread.start()
        try:
            self._serve(self.jobs[0], generate, is_cancelled)
        finally:
            for thread in threads:
                thread.join()
        if self.cancelled:
            raise Cancelled()

    def _serve(self, job: SequenceJob, generate: Generate,
               is_cancelled: Callable[[], bool]) -> None:
        params = job.params
        full_text = not params.stream and not params.exclude_input_in_output
        times = {"first_scheduled_time_ns": time.time_ns()}
        cum_log_prob = 0.0
        usage = RequestUsage()

        def emit(tokens: list[int], log_probs: list[TokenLogProb] | None, context: list[int],
                 final: bool) -> None:
            nonlocal cum_log_prob
            now = time.time_ns()
            times.setdefault("first_token_time_ns", now)
            times["last_token_time_ns"] = now
            meta = {"batch_index": job.batch_index, "sequence_index": job.sequence_index,
                    "full_text": final and full_text, "cached_tokens": usage.cached_tokens}
            if params.return_perf_metrics:
                meta["perf"] = {"arrival_time_ns": self.arrival_ns, **times,
                                **kv_cache_use(len(job.prompt_ids), usage.cached_tokens,
                                              self.kv_block)}
            if log_probs is not None:
                cum_log_prob += sum(p.log_prob for p in log_probs)
                meta["log_probs"] = {"tokens": [p.to_list() for p in log_probs],
                                     "cum": cum_log_prob, "top": params.top_log_probs}
            if meta["full_text"]:
                context = job.prompt_ids  # the text holds the prompt, then the generation
            self._answer(lambda last: self.send(tokens, context, meta, last), final)

        try:
            generate(job.prompt_ids, params, emit, is_cancelled, usage)
        except Cancelled:
            # No more tokens, but the final flag still: Triton 2.51 releases a request only
            # then, and a gRPC stream that held one kept its connection (and its fd) open.
            with self.lock:
                self.running -= 1
                self.cancelled = True
                if self.running == 0:
                    self.close()
        except Exception as exc:
            message = failure_message(exc)
            self._answer(lambda last: self.send_error(message, last), True)

    def _answer(self, answer: Callable[[bool], None], ends_sequence: bool) -> None:
        with self.lock:  # the count and the send together: one final flag, sent last
            if ends_sequence:
                self.running -= 1
            answer(self.running == 0)


# Failures of the nodes, not of the request: every node of a pool down, a lost pipeline or
# P-node, slots that never came free (each still so after the frontend's reruns and waits).
_NO_NODE = (NoNodeError, PipelineLost, PrefillLost, NodeBusy)


def failure_message(error: Exception) -> str:
    """What a client reads of a failed sequence: led by ``UNAVAILABLE`` when no node could
    serve it (not when a node refused it)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, _NO_NODE):
            return f"{UNAVAILABLE}: {error}"
        cause = cause.__cause__
    return str(error)
