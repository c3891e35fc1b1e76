"""One response of one sequence as the TensorRT-LLM backend's output tensors.

The text models (``ensemble``, ``tensorrt_llm_bls``) answer with
:func:`orchestrator.serving.text.decode_response`, the token model ``tensorrt_llm`` with
:func:`token_outputs`; both carry :func:`sequence_outputs`. Shapes are the backend's:
``[batch, beams, ...]`` with one row and one beam per response (each sequence of a
batched request answers on its own, told apart by ``batch_index`` and
``sequence_index``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from orchestrator.engine.log_probs import TokenLogProb, response_tensors

# The backend's perf-metric outputs and their dtypes ([1, 1] each); the speculative
# decoding ones hold their "no drafts" values here.
PERF = {"arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64,
        "first_token_time_ns": np.int64, "last_token_time_ns": np.int64,
        "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
        "kv_cache_alloc_total_blocks": np.int32, "acceptance_rate": np.float32,
        "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}
NO_DRAFTS = {"acceptance_rate": 0.0, "total_accepted_draft_tokens": 0, "total_draft_tokens": 0}


def kv_cache_use(prompt_tokens: int, cached_tokens: int, block_tokens: int
                 ) -> dict[str, int | float]:
    """One sequence's KV-cache counts in blocks of ``block_tokens`` (the prefix cache's,
    ``--kv-block``), the one place both contracts' ``kv_cache_*`` outputs come from
    (:class:`~orchestrator.serving.batch.BatchReply` calls it): the prompt's blocks, those
    a node's prefix cache held (``cached_tokens``: reused, each a hit) and the rest (new,
    each a miss)."""
    total = max(1, -(-prompt_tokens // block_tokens))
    reused = min(total, cached_tokens // block_tokens)
    return {"kv_cache_alloc_new_blocks": total - reused, "kv_cache_reused_blocks": reused,
            "kv_cache_missed_blocks": total - reused, "kv_cache_alloc_total_blocks": total,
            "kv_cache_hit_rate": reused / total}


def sequence_outputs(meta: Mapping) -> dict[str, np.ndarray]:
    """``batch_index``, ``sequence_index``, ``cached_tokens`` (the prompt's tokens a node's
    prefix cache held), the perf metrics and log-probs a response carries; ``meta`` is
    :class:`~orchestrator.serving.batch.BatchReply`'s."""
    outputs = {"batch_index": np.array([[meta["batch_index"]]], np.int32),
               "sequence_index": np.array([[meta["sequence_index"]]], np.int32),
               "cached_tokens": np.array([[meta.get("cached_tokens", 0)]], np.int32)}
    if "perf" in meta:
        perf = meta["perf"] | NO_DRAFTS
        for name, dtype in PERF.items():
            outputs[name] = np.array([[perf[name]]], dtype=dtype)
    if "log_probs" in meta:
        lp = meta["log_probs"]
        outputs |= response_tensors([TokenLogProb.from_list(p) for p in lp["tokens"]],
                                    lp["cum"], lp["top"])
    return outputs


def token_outputs(tokens: list[int], context: list[int], meta: Mapping
                  ) -> dict[str, np.ndarray]:
    """The token model's response: ``output_ids`` ``[1, 1, n]`` (streaming: the new
    tokens; else the prompt, unless excluded, then every new token) and
    ``sequence_length`` ``[1, 1]`` (n), as the backend's ``tensorrt_llm`` gives them."""
    ids = context + tokens if meta["full_text"] else tokens
    return {"output_ids": np.array(ids, np.int32).reshape(1, 1, len(ids)),
            "sequence_length": np.array([[len(ids)]], np.int32), **sequence_outputs(meta)}
