"""TensorRT-LLM's LLM-API Triton model (``triton_backend/all_models/llmapi/tensorrt_llm``),
served as ``tensorrt_llm`` under ``dejavu up --trtllm-api llmapi``.

One prompt's text in (``text_input`` ``[1]``; ``max_batch_size`` 0), the LLM API's
``SamplingParams`` as ``sampling_param_*`` inputs, text out. :func:`read_request` reads a
request into the ensemble's names, so one reader
(:meth:`~orchestrator.serving.params.GenerationParams.from_tensors`) checks it as every
other model's; :class:`LlmapiReply` shapes the responses.

SamplingParams' semantics: an unset ``max_tokens`` is 32; greedy unless ``top_k > 1`` or
``top_p > 0`` (its ``_greedy_decoding``: ``top_k`` unset or 1 and ``top_p`` unset or 0),
whatever the temperature, as :func:`~orchestrator.serving.params.trtllm_sampling` rules;
generation ends at the tokenizer's end token (``SamplingParams._setup``'s ``end_id``);
``stop`` strings end it too and are cut from the text (``include_stop_str_in_output``
false). ``exclude_input_from_output`` unset is false, as the model's helpers.py sends it:
a non-streaming answer's text holds the prompt, then the generation. A streamed response's
text is the generation so far (the LLM API's cumulative ``CompletionOutput.text``).

A request streams if its ``streaming`` input or its ``Streaming`` request parameter (what
``llmapi_client.py -S`` sends) is true, on a decoupled deployment only. A request with
``stop`` true ends every running request of its request id (:class:`StopRegistry`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from orchestrator.serving.batch import SequenceJob
from orchestrator.serving.entry import EntryPoint
from orchestrator.serving.params import MAX_WORDS, MAX_WORDS_BYTES, RequestError, as_text, refuse
from orchestrator.serving.text import encode_batch

DEFAULT_MAX_TOKENS = 32  # SamplingParams.max_tokens
# sampling_param_* -> the ensemble's name of the same parameter
SAMPLING = {
    "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k",
    "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_max_tokens": "max_tokens",
    "sampling_param_seed": "seed",
    "sampling_param_exclude_input_from_output": "exclude_input_in_output",
    "sampling_param_return_perf_metrics": "return_perf_metrics",
}
BEST_OF = "sampling_param_best_of"  # served at 1 only: one sequence, no beams
STOP_STRINGS = "sampling_param_stop"
# return_* input -> the output it adds to every response
OPTIONAL_OUTPUTS = {"return_finish_reason": "finish_reason",
                    "return_stop_reason": "stop_reason",
                    "return_cumulative_logprob": "cumulative_logprob"}
REFUSED = {"image_url": "multimodal input", "lora_id": "LoRA adapters",
           "lora_name": "LoRA adapters", "lora_path": "LoRA adapters",
           "lora_ckpt_source": "LoRA adapters"}
INPUTS = ("text_input", "streaming", "stop", BEST_OF, STOP_STRINGS, *SAMPLING,
          *OPTIONAL_OUTPUTS, *REFUSED)
_LLMAPI_NAME = {new: old for old, new in SAMPLING.items()}
_ENSEMBLE_NAME = re.compile(r"\b(" + "|".join(_LLMAPI_NAME) + r")\b")
STREAMING_PARAMETER = "Streaming"  # the request parameter llmapi_client.py sends
# The published config's perf outputs, from BatchReply's perf metrics (meta["perf"])
PERF = {"kv_cache_reused_block": ("kv_cache_reused_blocks", np.int32),
        "kv_cache_missed_block": ("kv_cache_missed_blocks", np.int32),
        "kv_cache_alloc_new_blocks": ("kv_cache_alloc_new_blocks", np.int32),
        "kv_cache_alloc_total_blocks": ("kv_cache_alloc_total_blocks", np.int32),
        "kv_cache_hit_rate": ("kv_cache_hit_rate", np.float32),
        "arrival_time_ns": ("arrival_time_ns", np.int64),
        "first_scheduled_time_ns": ("first_scheduled_time_ns", np.int64),
        "first_token_time_ns": ("first_token_time_ns", np.int64),
        "last_token_time_ns": ("last_token_time_ns", np.int64)}
NO_DRAFTS = {"acceptance_rate": np.array([0.0], np.float32),
             "total_accepted_draft_tokens": np.array([0], np.int32),
             "total_draft_tokens": np.array([0], np.int32)}


@dataclass(frozen=True)
class LlmapiRequest:
    """One request, read: its prompt, its parameters under the ensemble's names (``[1, 1]``
    tensors), its stop strings and the optional outputs it asked for."""

    prompt: str
    tensors: dict[str, np.ndarray]
    stop: tuple[str, ...] = ()
    outputs: frozenset[str] = field(default_factory=frozenset)
    streaming: bool = False


def is_stop(tensors: Mapping[str, np.ndarray | None]) -> bool:
    """Whether a request is a stop request (``stop`` true)."""
    stop = tensors.get("stop")
    return stop is not None and bool(np.asarray(stop).any())


def read_request(tensors: Mapping[str, np.ndarray | None], parameters: Mapping[str, object]
                 ) -> LlmapiRequest:
    """A request's inputs (read by the names in ``INPUTS``) and its request parameters;
    raises RequestError naming the input it cannot serve."""
    for name, what in REFUSED.items():
        if tensors.get(name) is not None:
            refuse(name, tensors[name], what)
    text = tensors.get("text_input")
    if text is None or text.size == 0:
        raise RequestError("text_input is required")
    if text.size != 1:
        raise RequestError(f"text_input holds {text.size} prompts: this model takes one per "
                           "request (max_batch_size 0)")
    best_of = _scalar(tensors, BEST_OF)
    if best_of is not None and int(best_of) != 1:
        raise RequestError(f"{BEST_OF} {int(best_of)} is not supported: only 1 (one "
                           "sequence per request here)")
    converted = {new: np.asarray(tensors[old]).reshape(1, 1) for old, new in SAMPLING.items()
                 if tensors.get(old) is not None}
    converted.setdefault("max_tokens", np.array([[DEFAULT_MAX_TOKENS]], np.int32))
    outputs = frozenset(out for name, out in OPTIONAL_OUTPUTS.items()
                        if bool(_scalar(tensors, name)))
    if "cumulative_logprob" in outputs:
        converted["return_log_probs"] = np.array([[True]])
    streaming = bool(_scalar(tensors, "streaming")) or _flag(parameters, STREAMING_PARAMETER)
    converted["stream"] = np.array([[streaming]])
    return LlmapiRequest(as_text(text.reshape(-1)[0]), converted,
                         _stop_strings(tensors.get(STOP_STRINGS)), outputs, streaming)


def llmapi_jobs(entry: EntryPoint, tokenizer: Tokenizer, end_pad: tuple[int | None, int | None],
                decoupled: bool, tensors: Mapping[str, np.ndarray | None],
                parameters: Mapping[str, object], reply: LlmapiReply) -> list[SequenceJob]:
    """A request's one sequence (``entry.split``), its prompt tokenized and its stop
    strings too (each alone, without special tokens, as SamplingParams does); ``reply``
    started with it. Raises RequestError for what it cannot serve."""
    request = read_request(tensors, parameters)
    if request.streaming and not decoupled:
        raise RequestError("streaming (the streaming input or the Streaming parameter) is "
                           "only supported in decoupled mode: deploy tensorrt_llm decoupled "
                           "(dejavu up --trtllm-decoupled true)")
    prompt = np.array([[request.prompt]], dtype=np.object_)
    words = [tokenizer.encode(s, add_special_tokens=False).ids for s in request.stop]
    try:
        jobs = entry.split({**request.tensors,
                            **encode_batch(tokenizer, entry.limits, {"text_input": prompt},
                                           end_pad),
                            "stop_ids": np.array([[json.dumps(words).encode()]], np.object_)})
    except RequestError as exc:  # named as the client sent it: sampling_param_top_p, ...
        raise RequestError(_ENSEMBLE_NAME.sub(lambda m: _LLMAPI_NAME[m.group(0)], str(exc))
                           ) from None
    reply.start(request, jobs[0].prompt_ids, words)
    return jobs


class LlmapiReply:
    """The responses of one request's one sequence: ``text_output`` (the generation so far
    when streaming; else all of it, after the prompt unless excluded), and the outputs it
    asked for: ``finish_reason`` and ``stop_reason`` (as the model writes the LLM API's,
    ``str()`` of them: "None" until the end), ``cumulative_logprob``, and with
    ``sampling_param_return_perf_metrics`` the perf metrics and ``kv_cache_*`` counts.
    :meth:`start` gives it the request once it is read."""

    def __init__(self, tokenizer: Tokenizer, end_id: int | None) -> None:
        self.tokenizer, self.end_id = tokenizer, end_id
        self.request = LlmapiRequest("", {})
        self.prompt_ids: list[int] = []
        self.stop_words: list[tuple[str, list[int]]] = []
        self.generated: list[int] = []

    def start(self, request: LlmapiRequest, prompt_ids: list[int],
              stop_ids: list[list[int]]) -> None:
        """``stop_ids``: each of the request's stop strings as tokens."""
        self.request, self.prompt_ids = request, prompt_ids
        self.stop_words = list(zip(request.stop, stop_ids, strict=True))

    def respond(self, tokens: list[int], meta: Mapping, final: bool) -> dict[str, np.ndarray]:
        """The response that carries ``tokens`` (:class:`~orchestrator.serving.batch.
        BatchReply`'s send; ``final``: the sequence's last)."""
        self.generated += tokens
        kept, stopped_by = self.generated, None
        if final:
            kept, stopped_by = self._cut_stop_string()
        context = [] if self.request.streaming or not meta["full_text"] else self.prompt_ids
        text = self.tokenizer.decode(context + kept, skip_special_tokens=True)
        outputs = {"text_output": np.array([text.encode()], dtype=np.object_)}
        if "finish_reason" in self.request.outputs:
            outputs["finish_reason"] = _string(self._finish_reason(stopped_by) if final else None)
        if "stop_reason" in self.request.outputs:
            outputs["stop_reason"] = _string(stopped_by)
        if "cumulative_logprob" in self.request.outputs:
            outputs["cumulative_logprob"] = np.array([meta["log_probs"]["cum"]], np.float32)
        if "perf" in meta:
            outputs |= {name: np.array([meta["perf"][key]], dtype)
                        for name, (key, dtype) in PERF.items()} | NO_DRAFTS
        return outputs

    def _cut_stop_string(self) -> tuple[list[int], str | None]:
        """The generated tokens without a stop string they end with, and that string."""
        for text, ids in self.stop_words:
            if ids and self.generated[-len(ids):] == ids:
                return self.generated[: -len(ids)], text
        return self.generated, None

    def _finish_reason(self, stopped_by: str | None) -> str:
        ended = self.end_id is not None and self.generated[-1:] == [self.end_id]
        return "stop" if stopped_by is not None or ended else "length"


class StopRegistry:
    """The running requests by request id, so a ``stop`` request ends them: each running
    request polls its event (with the client's own cancellation)."""

    def __init__(self) -> None:
        self.running: dict[str, list[threading.Event]] = {}
        self.lock = threading.Lock()

    def register(self, request_id: str) -> threading.Event:
        event = threading.Event()
        if request_id:
            with self.lock:
                self.running.setdefault(request_id, []).append(event)
        return event

    def unregister(self, request_id: str, event: threading.Event) -> None:
        with self.lock:
            events = self.running.get(request_id, [])
            if event in events:
                events.remove(event)
            if not events:
                self.running.pop(request_id, None)

    def stop(self, request_id: str) -> int:
        """Ends every running request of ``request_id``; how many. An empty id is refused
        (the model's "A request id must be provided for request cancellation")."""
        if not request_id:
            raise RequestError("stop true needs the request id of the request to stop: a "
                               "request id must be provided for request cancellation")
        with self.lock:
            events = list(self.running.get(request_id, []))
        for event in events:
            event.set()
        return len(events)


def _scalar(tensors: Mapping[str, np.ndarray | None], name: str) -> object | None:
    array = tensors.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0].item()


def _flag(parameters: Mapping[str, object], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"request parameter {name} must be a bool, got {value!r}")
    return value


def _stop_strings(array: np.ndarray | None) -> tuple[str, ...]:
    """``sampling_param_stop``: each element one stop string (empty ones ignored)."""
    if array is None:
        return ()
    values = [v for v in np.asarray(array).reshape(-1).tolist() if v not in (b"", "")]
    if len(values) > MAX_WORDS:
        raise RequestError(f"{STOP_STRINGS}: {len(values)} strings, at most {MAX_WORDS}")
    raw = [v if isinstance(v, bytes) else str(v).encode() for v in values]
    if sum(map(len, raw)) > MAX_WORDS_BYTES:
        raise RequestError(f"{STOP_STRINGS}: more than {MAX_WORDS_BYTES} bytes")
    try:
        return tuple(v.decode("utf-8") for v in raw)
    except UnicodeDecodeError as exc:
        raise RequestError(f"{STOP_STRINGS}: not UTF-8 ({exc})") from None


def _string(value: str | None) -> np.ndarray:
    return np.array([str(value).encode()], dtype=np.object_)
