"""Text in and out: tokenize prompts, detokenize tokens as they stream.

:func:`encode_batch` is what the ``preprocessing`` model does to a batched request and
:func:`decode_response` what the ``orchestrator`` model does to each response;
``tensorrt_llm_bls`` calls both in-process.

Streaming sends a few tokens at a time, and a token's text can depend on the
ones before it (merged spaces, multi-byte characters split across tokens). So
each streamed response carries the last ``CONTEXT_TOKENS`` tokens already sent;
the new text is what the new tokens add to that context's text. This keeps
detokenizing stateless.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from tokenizers import Tokenizer

from orchestrator.engine.log_probs import TokenLogProb, response_tensors
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.params import RequestError, parse_words

CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence
# The backend's perf-metric outputs and their dtypes ([batch, 1] each).
PERF = {"arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64,
        "first_token_time_ns": np.int64, "last_token_time_ns": np.int64,
        "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
        "kv_cache_alloc_total_blocks": np.int32}
TEXT_INPUTS = ("text_input", "stop_words", "bad_words")


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        raise RequestError("empty prompt: text_input is empty")
    ids = tokenizer.encode(text).ids
    if not ids:
        raise RequestError(f"prompt {text[:40]!r} has no tokens")
    return ids


def new_text(tokenizer: Tokenizer, context: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``context`` (both token ids)."""
    before = tokenizer.decode(context, skip_special_tokens=True)
    after = tokenizer.decode(context + new, skip_special_tokens=True)
    if after.startswith(before):
        return after[len(before) :]
    # The context's text ended in half a character the new tokens complete.
    before = before.rstrip(REPLACEMENT)
    return after[len(before) :]


def encode_words(tokenizer: Tokenizer, values: list[bytes | str]) -> str:
    """``stop_words`` / ``bad_words`` of one row (the backend's string form) as a JSON list
    of token lists, each word tokenized alone as the backend does."""
    return json.dumps([tokenizer.encode(word, add_special_tokens=False).ids
                       for word in parse_words(values)])


def response_text(tokenizer: Tokenizer, tokens: list[int], context: list[int],
                  full_text: bool) -> str:
    """``full_text``: the text of context + tokens (a non-streaming answer that holds its
    prompt); else the text the tokens add after the context."""
    if full_text:
        return tokenizer.decode(context + tokens, skip_special_tokens=True)
    return new_text(tokenizer, context, tokens)


def encode_batch(tokenizer: Tokenizer, limits: RequestLimits,
                 tensors: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """A batched request's ``TEXT_INPUTS`` as token tensors: ``input_ids`` (rows padded with
    0 to the longest), ``input_lengths`` ``[rows, 1]``, and each row's stop / bad words as
    JSON token lists (``stop_ids``, ``bad_ids``, ``[rows, 1]``). A prompt over the byte
    limit is refused (RequestError) before it is decoded or tokenized."""
    if tensors.get("text_input") is None:
        raise RequestError("text_input is required")
    rows = [encode_prompt(tokenizer, limits.check_text(row)) for row in tensors["text_input"]]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    encoded = {"input_ids": ids, "input_lengths": np.array([[len(r)] for r in rows], np.int32)}
    for name, out in (("stop_words", "stop_ids"), ("bad_words", "bad_ids")):
        array = tensors.get(name)
        words = [encode_words(tokenizer, [] if array is None else list(array[i]))
                 for i in range(len(rows))]
        encoded[out] = np.array([[w.encode()] for w in words], dtype=np.object_)
    return encoded


def decode_response(tokenizer: Tokenizer, tokens: list[int], context: list[int],
                    meta: Mapping) -> dict[str, np.ndarray]:
    """One response of one sequence as the backend's output tensors (``[1, ...]``):
    ``text_output``, ``output_ids``, ``batch_index``, ``sequence_index``, the perf metrics
    and the log-probs; ``meta`` is :class:`~orchestrator.serving.batch.BatchReply`'s."""
    text = response_text(tokenizer, tokens, context, meta["full_text"])
    outputs = {
        "text_output": np.array([[text.encode()]], dtype=np.object_),
        "output_ids": np.array([tokens], dtype=np.int32),
        "batch_index": np.array([[meta["batch_index"]]], np.int32),
        "sequence_index": np.array([[meta["sequence_index"]]], np.int32),
    }
    for name, value in meta.get("perf", {}).items():
        outputs[name] = np.array([[value]], dtype=PERF[name])
    if "log_probs" in meta:
        lp = meta["log_probs"]
        outputs |= response_tensors([TokenLogProb.from_list(p) for p in lp["tokens"]],
                                    lp["cum"], lp["top"])
    return outputs
