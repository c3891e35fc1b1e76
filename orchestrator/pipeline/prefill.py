"""The prompt side: prefill on its own engines, stream the KV to the token stages.

:func:`stream_prefill` runs whole prompts (its engines may be a different split
of the same model), samples each first token, and streams each layer as it is
made through the KV library's ``KVSender`` into every token stage's
``KVReceiver`` (the library routes layers to the stage holding them: DejaVu's
stream_out/stream_in), with the first token as the transfer's ``extra``. A
prompt whose leading blocks the node's prefix cache held sends those positions
of every layer at once, before its rest computes (``KVSender.save_ahead``). Asked
to stop (its client left), it stops after the layer in progress and gives every
staging block back, as on any other exit. A P-node runs it
(:class:`~orchestrator.serving.prefill_worker.PrefillWorker`), and so does an in-process pipeline
(:class:`~orchestrator.pipeline.local.LocalPipeline`).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.kv.connector import KVSender, SendHandle
from orchestrator.kv.errors import KVTransferError
from orchestrator.layout import KVCache
from orchestrator.pipeline.prefix import PrefixLoad, PrefixReuse

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


class _AheadPosts:
    """Posts the cached positions of every layer of the prompts that hit (``save_ahead``)
    from a thread of its own: packing them into staging overlaps the rest's compute, and
    the first computed layer waits for them (they go first)."""

    def __init__(self, senders: Sequence[KVSender], handles: Sequence[Sequence[SendHandle]],
                 slots: Sequence[Sequence[KVCache]], loads: Sequence[PrefixLoad],
                 timeout_s: float) -> None:
        self._error: BaseException | None = None
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._post, args=(senders, handles, slots, loads),
                                        name="kv-ahead", daemon=True)
        self._thread.start()

    def _post(self, senders, handles, slots, loads) -> None:
        try:
            for sender, stage_handles, caches in zip(senders, handles, slots, strict=True):
                for handle, cache, load in zip(stage_handles, caches, loads, strict=True):
                    sender.save_ahead(handle, cache, load.cached_tokens)
        except BaseException as error:  # noqa: BLE001  (raised in the prefill's thread)
            self._error = error

    def wait(self, check: bool = True) -> None:
        """Until every cached part is posted (bounded); ``check``: raises what posting
        raised, or that it did not end in time (else a handle released meanwhile makes
        what is left of it post nothing)."""
        self._thread.join(self._timeout_s)
        if not check:
            return
        if self._thread.is_alive():
            raise KVTransferError("<local>", f"cached KV not posted in {self._timeout_s}s")
        if self._error is not None:
            raise self._error


def stream_prefill(
    engines: Sequence[Engine],
    senders: Sequence[KVSender],
    prompts: Mapping[str, Sequence[int]],
    tickets: Mapping[str, Sequence[bytes]],
    sampling: Mapping[str, SamplingParams] | None = None,
    save_timeout_s: float = 30.0,
    log_probs: dict[str, TokenLogProb] | None = None,
    stop: Callable[[], bool] | None = None,
    prefix: PrefixReuse | None = None,
    salts: Mapping[str, str] | None = None,
    cached: dict[str, int] | None = None,
    sent: dict[str, int] | None = None,
    ahead: dict[str, int] | None = None,
) -> dict[str, int]:
    """Prefill ``prompts`` (request id -> ids) on the prompt stages ``engines`` (one
    ``KVSender`` each), streaming every layer's KV while the next computes to the token
    stages that reserved ``tickets[request_id]`` (one ticket per token stage). Returns each
    first token (and puts into ``log_probs`` the log-prob of those whose sampling asks);
    raises ``KVTransferError`` naming the token stage a transfer failed to, or
    ``PrefillCancelled`` when ``stop()`` says so (asked after every layer).

    With ``prefix`` (the node's prefix cache), each prompt's cached leading blocks (under
    ``salts[request_id]``) are loaded into its slots and only the rest is computed; the
    cached positions of every layer stream at once while the rest computes, and each
    layer then streams its computed positions (the first waits for the cached ones).
    ``cached`` gets each prompt's cached tokens,
    ``sent`` the KV bytes streamed for it (less than its whole KV where a token stage held
    its leading positions: decode-side reuse), ``ahead`` those of them that went ahead
    of the computed ones."""
    sampling, salts = sampling or {}, salts or {}
    rids = list(prompts)
    slots = [[engine.new_cache() for _ in rids] for engine in engines]
    loads: list[PrefixLoad] = []
    x: list[torch.Tensor] = [torch.tensor(prompts[r], dtype=torch.long) for r in rids]
    taken: list[tuple[KVSender, SendHandle]] = []  # every staging block, given back on any exit
    ahead_posts: _AheadPosts | None = None
    done = False
    try:
        if prefix is not None:
            for i, rid in enumerate(rids):
                loads.append(prefix.load(prompts[rid], salts.get(rid, ""), [s[i] for s in slots]))
            x = [load.rest for load in loads]
            if cached is not None:
                cached.update({rid: load.cached_tokens for rid, load in zip(rids, loads,
                                                                            strict=True)})
        # Every stage's handles from the start: a prefill that stops early gives up on each
        # stage's layers, so its token stages know no writer is left (their slots free).
        handles: list[list[SendHandle]] = []
        for sender in senders:
            handles.append([])
            for rid in rids:
                handles[-1].append(sender.start(rid, list(tickets[rid])))
                taken.append((sender, handles[-1][-1]))
        if any(load.cached_tokens for load in loads):
            ahead_posts = _AheadPosts(senders, handles, slots, loads, save_timeout_s)
        for engine, sender, stage_handles, caches in zip(engines, senders, handles, slots,
                                                         strict=True):

            def save(layer: int, caches: Sequence[KVCache], sender=sender,
                     hs=stage_handles) -> None:
                if ahead_posts is not None:  # every layer's cached part goes first
                    ahead_posts.wait()
                for handle, cache in zip(hs, caches, strict=True):
                    sender.save_layer(handle, layer, cache)
                if stop is not None and stop():
                    raise PrefillCancelled(f"cancelled after layer {layer}")

            x = engine.prefill(x, caches, on_layer=save)
        done = True
        first = {}
        for rid, logits in zip(rids, x, strict=True):
            first[rid], log_prob = Sampler(sampling.get(rid)).pick(logits[None])
            if log_prob is not None and log_probs is not None:
                log_probs[rid] = log_prob
        for sender, handle in taken:
            sender.finish(handle, extra=encode_first_token(first[handle.request_id]))
        for sender, handle in taken:
            sender.wait_for_save(handle, save_timeout_s)
            for counts, nbytes in ((sent, handle.sent_bytes), (ahead, handle.ahead_bytes)):
                if counts is not None:
                    counts[handle.request_id] = counts.get(handle.request_id, 0) + nbytes
    finally:
        if ahead_posts is not None:  # nothing posts into a staging block given back
            ahead_posts.wait(check=False)
        for sender, handle in taken:
            sender.release(handle)
        for i, load in enumerate(loads):  # a prefill that stopped early stores nothing
            prefix.finish(load, [s[i] for s in slots] if done else None)  # type: ignore[union-attr]
    return first
