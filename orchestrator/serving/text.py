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

from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.outputs import sequence_outputs
from orchestrator.serving.params import RequestError, parse_words

CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence
# what preprocessing reads (end_id / pad_id: to fill in the tokenizer's where absent)
TEXT_INPUTS = ("text_input", "stop_words", "bad_words", "end_id", "pad_id")


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        raise RequestError("empty prompt: text_input is empty")
    # encode_batch releases the GIL while it works (encode holds it): a long prompt does not
    # stall the other requests' threads in this process meanwhile.
    ids = tokenizer.encode_batch([text])[0].ids
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
                 tensors: Mapping[str, np.ndarray | None],
                 end_pad: tuple[int | None, int | None] = (None, None)) -> dict[str, np.ndarray]:
    """A batched request's ``TEXT_INPUTS`` as token tensors: ``input_ids`` (rows padded with
    0 to the longest), ``input_lengths`` ``[rows, 1]``, and each row's stop / bad words as
    JSON token lists (``stop_ids``, ``bad_ids``, ``[rows, 1]``). A prompt over the byte
    limit is refused (RequestError) before it is decoded or tokenized. ``end_id`` and
    ``pad_id`` ``[rows, 1]``: the request's, else ``end_pad`` (the tokenizer's:
    :func:`~orchestrator.engine.tokenizer.end_and_pad_ids`; -1 for none), as the backend's
    preprocessing fills them in."""
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
    for name, default in zip(("end_id", "pad_id"), end_pad, strict=True):
        sent = tensors.get(name)
        encoded[name] = (np.asarray(sent, np.int32) if sent is not None else
                         np.full((len(rows), 1), -1 if default is None else default, np.int32))
    return encoded


def decode_response(tokenizer: Tokenizer, tokens: list[int], context: list[int],
                    meta: Mapping) -> dict[str, np.ndarray]:
    """One response of one sequence as the text models' output tensors: ``text_output``
    1-D (``[1]``: one sequence, one beam), as the backend's postprocessing shapes it, so
    ``as_numpy("text_output")[0]`` is the text's bytes; ``output_ids`` (this project's:
    the response's new tokens) and :func:`~orchestrator.serving.outputs.sequence_outputs`."""
    text = response_text(tokenizer, tokens, context, meta["full_text"])
    return {"text_output": np.array([text.encode()], dtype=np.object_),
            "output_ids": np.array([tokens], dtype=np.int32), **sequence_outputs(meta)}


def detokenize_batch(tokenizer: Tokenizer, tokens: np.ndarray, lengths: np.ndarray
                     ) -> np.ndarray:
    """The ``postprocessing`` model's work: ``tokens`` ``[batch, beams, n]`` with
    ``lengths`` ``[batch, beams]`` (each beam's first ``length`` tokens are its own) as
    one text per beam, 1-D (``[batch * beams]``) as the backend's postprocessing gives it."""
    if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
        raise RequestError(f"TOKENS_BATCH must be [batch, beams, tokens] and SEQUENCE_LENGTH "
                           f"[batch, beams], got {list(tokens.shape)} and "
                           f"{list(lengths.shape)}")
    texts = []
    for beam, length in zip(tokens.reshape(-1, tokens.shape[2]), lengths.reshape(-1),
                            strict=True):
        if not 0 <= length <= len(beam):
            raise RequestError(f"SEQUENCE_LENGTH {length} outside [0, {len(beam)}]")
        texts.append(tokenizer.decode(beam[:length].tolist(), skip_special_tokens=True).encode())
    return np.array(texts, dtype=np.object_)
