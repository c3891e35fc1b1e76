"""The prompt side: prefill on its own engines, stream the KV to the token stages.

:func:`stream_prefill` runs whole prompts (its engines may be a different split
of the same model), samples each first token, and streams each layer as it is
made through the KV library's ``KVSender`` into every token stage's
``KVReceiver`` (the library routes layers to the stage holding them: DejaVu's
stream_out/stream_in), with the first token as the transfer's ``extra``. Asked
to stop (its client left), it stops after the layer in progress and gives every
staging block back, as on any other exit. A P-node runs it
(:class:`~orchestrator.serving.prefill_worker.PrefillWorker`), and so does an in-process pipeline
(:class:`~orchestrator.pipeline.local.LocalPipeline`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping, Sequence

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.kv.connector import KVSender, SendHandle
from orchestrator.layout import KVCache

log = logging.getLogger(__name__)
_FIRST_TOKEN = struct.Struct("<I")  # what the serving P-node sends too


class PrefillCancelled(Exception):
    """The prefill stopped before its end: every request in it was cancelled."""


def encode_first_token(token: int) -> bytes:
    return _FIRST_TOKEN.pack(token)


def decode_first_token(extra: bytes) -> int:
    if len(extra) != _FIRST_TOKEN.size:
        raise ValueError(f"expected a {_FIRST_TOKEN.size}-byte first token after the prompt KV, "
                         f"got {len(extra)} bytes")
    return _FIRST_TOKEN.unpack(extra)[0]


def stream_prefill(
    engines: Sequence[Engine],
    senders: Sequence[KVSender],
    prompts: Mapping[str, Sequence[int]],
    tickets: Mapping[str, Sequence[bytes]],
    sampling: Mapping[str, SamplingParams] | None = None,
    save_timeout_s: float = 30.0,
    log_probs: dict[str, TokenLogProb] | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, int]:
    """Prefill ``prompts`` (request id -> ids) on the prompt stages ``engines`` (one
    ``KVSender`` each), streaming every layer's KV while the next computes to the token
    stages that reserved ``tickets[request_id]`` (one ticket per token stage). Returns each
    first token (and puts into ``log_probs`` the log-prob of those whose sampling asks);
    raises ``KVTransferError`` naming the token stage a transfer failed to, or
    ``PrefillCancelled`` when ``stop()`` says so (asked after every layer)."""
    sampling = sampling or {}
    rids = list(prompts)
    x: list[torch.Tensor] = [torch.tensor(prompts[r], dtype=torch.long) for r in rids]
    taken: list[tuple[KVSender, SendHandle]] = []  # every staging block, given back on any exit
    try:
        # Every stage's handles from the start: a prefill that stops early gives up on each
        # stage's layers, so its token stages know no writer is left (their slots free).
        handles: list[list[SendHandle]] = []
        for sender in senders:
            handles.append([])
            for rid in rids:
                handles[-1].append(sender.start(rid, list(tickets[rid])))
                taken.append((sender, handles[-1][-1]))
        for engine, sender, stage_handles in zip(engines, senders, handles, strict=True):

            def save(layer: int, caches: Sequence[KVCache], sender=sender,
                     hs=stage_handles) -> None:
                for handle, cache in zip(hs, caches, strict=True):
                    sender.save_layer(handle, layer, cache)
                if stop is not None and stop():
                    raise PrefillCancelled(f"cancelled after layer {layer}")

            x = engine.prefill(x, [engine.new_cache() for _ in rids], on_layer=save)
        first = {}
        for rid, logits in zip(rids, x, strict=True):
            first[rid], log_prob = Sampler(sampling.get(rid)).pick(logits[None])
            if log_prob is not None and log_probs is not None:
                log_probs[rid] = log_prob
        for sender, handle in taken:
            sender.finish(handle, extra=encode_first_token(first[handle.request_id]))
        for sender, handle in taken:
            sender.wait_for_save(handle, save_timeout_s)
    finally:
        for sender, handle in taken:
            sender.release(handle)
    return first
