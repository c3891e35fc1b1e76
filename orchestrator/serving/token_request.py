"""A request to the token model ``tensorrt_llm`` read as the ensemble's.

``tensorrt_llm`` is the TensorRT-LLM backend's token-level model: token ids in
(``input_ids``, ``input_lengths``), token ids out. Its inputs are the ensemble's under
other names (``request_output_len`` for ``max_tokens``, ``runtime_top_k`` for ``top_k``,
...), its stop and bad words come as token lists (``[2, n]`` per row: the words' tokens
one after another, then each word's end offset, padded with -1), and it takes a few inputs
the ensemble does not (all refused here, but ``early_stopping`` and
``beam_search_diversity_rate``, which act only in beam search, and ``stop`` false).
:func:`ensemble_tensors` renames and converts them so one reader
(:meth:`~orchestrator.serving.params.GenerationParams.from_tensors`) checks every model's
requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

import numpy as np

from orchestrator.serving.params import INPUTS, MAX_WORDS, RequestError, refuse

# tensorrt_llm's name -> the ensemble's
RENAMED = {"request_output_len": "max_tokens", "runtime_top_k": "top_k",
           "runtime_top_p": "top_p", "streaming": "stream", "len_penalty": "length_penalty"}
WORD_LISTS = {"stop_words_list": "stop_ids", "bad_words_list": "bad_ids"}
BEAM_ONLY = ("early_stopping", "beam_search_diversity_rate")  # no effect at beam_width 1
# Inputs of tensorrt_llm alone, refused whenever they hold a value.
REFUSED = {
    "encoder_input_features": "encoder-decoder models",
    "encoder_output_lengths": "encoder-decoder models",
    "decoder_input_ids": "encoder-decoder models",
    "decoder_input_lengths": "encoder-decoder models",
    "draft_input_ids": "speculative decoding",
    "draft_logits": "speculative decoding",
    "draft_acceptance_threshold": "speculative decoding",
    "embedding_bias": "embedding bias",
    "runtime_top_p_min": "top-p decay",
    "runtime_top_p_decay": "top-p decay",
    "runtime_top_p_reset_ids": "top-p decay",
    "prompt_table_extra_ids": "prompt tables (p-tuning)",
    "cross_attention_mask": "multimodal input",
    "skip_cross_attn_blocks": "multimodal input",
    "mrope_rotary_cos_sin": "multimodal input",
    "mrope_position_deltas": "multimodal input",
    "context_phase_params": "TensorRT-LLM's own disaggregated context phases",
    **{f"retention_{name}": "KV cache retention priorities" for name in (
        "token_range_starts", "token_range_ends", "token_range_priorities",
        "token_range_durations_ms", "decode_priority", "decode_duration_ms")},
    **{f"lookahead_{name}": "lookahead decoding" for name in (
        "window_size", "ngram_size", "verification_set_size")},
}
SHARED = tuple(name for name in INPUTS if name not in RENAMED.values())
# What the model reads (BEAM_ONLY's are accepted and have no effect: not read).
TOKEN_INPUTS = ("input_ids", "input_lengths", "stop", *RENAMED, *WORD_LISTS, *REFUSED, *SHARED)


def token_jobs(split: Callable[[Mapping[str, np.ndarray | None]], list],
               tensors: Mapping[str, np.ndarray | None]) -> list:
    """``split`` (:meth:`~orchestrator.serving.entry.EntryPoint.split`) of a token request;
    a refusal names the inputs as the client sent them (``runtime_top_p``, not ``top_p``)."""
    try:
        return split(ensemble_tensors(tensors))
    except RequestError as exc:
        raise RequestError(_TOKEN_NAME.sub(lambda m: _OLD_NAME[m.group(0)], str(exc))) from None


def check_unary(jobs: list) -> list:
    """``jobs`` (one request's sequences), refused as the backend refuses them when
    ``tensorrt_llm`` is not decoupled: one response carries one sequence, whole."""
    if any(job.params.stream for job in jobs):
        raise RequestError("streaming is only supported if tensorrt_llm is deployed "
                           "decoupled (dejavu up --trtllm-decoupled true)")
    if len(jobs) > 1:
        raise RequestError(f"{len(jobs)} sequences (batch rows x num_return_sequences): a "
                           "non-decoupled tensorrt_llm answers one sequence per request "
                           "(dejavu up --trtllm-decoupled true serves more)")
    return jobs


_OLD_NAME = {new: old for old, new in (RENAMED | WORD_LISTS).items()}
_TOKEN_NAME = re.compile(r"\b(" + "|".join(_OLD_NAME) + r")\b")


def ensemble_tensors(tensors: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """``tensors`` (read by the names in ``TOKEN_INPUTS``) under the ensemble's names;
    raises RequestError for an input this server does not support."""
    for name, what in REFUSED.items():
        if tensors.get(name) is not None:
            refuse(name, tensors[name], what)
    stop = tensors.get("stop")
    if stop is not None and stop.any():
        raise RequestError("stop true is refused: to stop a request, cancel it")
    out = {name: tensors.get(name) for name in ("input_ids", "input_lengths", *SHARED)}
    out |= {new: tensors.get(old) for old, new in RENAMED.items()}
    for old, new in WORD_LISTS.items():
        lists = tensors.get(old)
        out[new] = None if lists is None else np.array(
            [[json.dumps(words(old, row)).encode()] for row in lists], dtype=np.object_)
    return out


def words(name: str, row: np.ndarray) -> list[list[int]]:
    """One row's ``[2, n]`` word list (tokens, then end offsets padded with -1) as token
    lists."""
    row = np.asarray(row)
    if row.ndim != 2 or row.shape[0] != 2:
        raise RequestError(f"{name} must be [batch, 2, n], got a row of shape {list(row.shape)}")
    tokens, ends = row[0].tolist(), [int(e) for e in row[1] if e >= 0]
    if len(ends) > MAX_WORDS:
        raise RequestError(f"{len(ends)} words in {name}: at most {MAX_WORDS}")
    found, start = [], 0
    for end in ends:
        if not start <= end <= len(tokens):
            raise RequestError(f"{name}: offset {end} outside [{start}, {len(tokens)}]")
        found.append(tokens[start:end])
        start = end
    return found
