"""The prompt side: prefill on its own engines, hand the KV to the token stages.

A P-worker runs whole prompts (its engines may be a different split of the
same model), samples each first token, and regroups the prompt KV by the token
pipeline's layer ranges (DejaVu's stream_out/stream_in: split at the source,
merge at the destination). In one process it puts the KV in a
:class:`PromptKVStore`, where each token stage takes its part when the
sequence is admitted. Across processes, :func:`stream_prefill` streams each
layer as it is made through the KV library's ``KVSender`` into every token
stage's ``KVReceiver`` (the library routes layers to the stage holding them),
with the first token as the transfer's ``extra``.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.kv.connector import KVSender, SendHandle
from orchestrator.kv.primitives import region_view, routes
from orchestrator.kv.transport.base import KVPoll
from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.sequence import FinishReason
from orchestrator.pipeline.sequence import Sequence as Seq
from orchestrator.pipeline.stage import Interval

log = logging.getLogger(__name__)
_FIRST_TOKEN = struct.Struct("<I")  # what the serving P-node sends too


def encode_first_token(token: int) -> bytes:
    return _FIRST_TOKEN.pack(token)


def decode_first_token(extra: bytes) -> int:
    if len(extra) != _FIRST_TOKEN.size:
        raise ValueError(f"expected a {_FIRST_TOKEN.size}-byte first token after the prompt KV, "
                         f"got {len(extra)} bytes")
    return _FIRST_TOKEN.unpack(extra)[0]


class PromptKVStore:
    """Prompt KV per (sequence, token stage), in host memory, until the stage takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kv: dict[tuple[int, int], KVCache] = {}

    def put(self, seq_id: int, stage_index: int, cache: KVCache) -> None:
        with self._lock:
            self._kv[seq_id, stage_index] = cache

    def take(self, seq_id: int, stage_index: int) -> KVCache:
        with self._lock:
            try:
                return self._kv.pop((seq_id, stage_index))
            except KeyError:
                raise KeyError(
                    f"no prompt KV for sequence {seq_id} at stage {stage_index}"
                ) from None

    def probe(self, seq_id: int, request_id: str, stage_index: int) -> tuple[KVPoll, str]:
        """In one process the head admits with the first token in hand and never probes;
        the store knows only whether the KV is there."""
        with self._lock:
            return (KVPoll.SUCCESS if (seq_id, stage_index) in self._kv else KVPoll.WAITING), ""

    def discard(self, seq_id: int, request_id: str | None = None) -> None:
        with self._lock:
            for key in [k for k in self._kv if k[0] == seq_id]:
                del self._kv[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._kv)


def regroup(caches: Sequence[KVCache], layouts: Sequence[KVLayout], length: int) -> list[KVCache]:
    """Re-cut one sequence's prompt KV from the prompt stages' layer ranges into the token
    stages' (``layouts``), copying positions ``[0, length)``."""
    src = [range(c.layout.first_layer, c.layout.first_layer + c.layout.num_layers) for c in caches]
    dst = [range(lay.first_layer, lay.first_layer + lay.num_layers) for lay in layouts]
    out = [KVCache.empty(layout) for layout in layouts]
    positions = range(length)
    for route in routes(src, dst):
        region_view(out[route.dst], route.layers, positions).copy_(
            region_view(caches[route.src], route.layers, positions)
        )
    for cache in out:
        cache.length = length
    return out


# (sequence, first token): its prompt KV is in the store
ReadyCallback = Callable[[Seq, int], None]


class PromptWorker:
    """Prefills queued prompts in batches of up to ``max_batch`` on its own thread."""

    def __init__(
        self,
        engines: Sequence[Engine],
        token_layouts: Sequence[KVLayout],
        store: PromptKVStore,
        on_ready: ReadyCallback,
        max_batch: int = 4,
        poll_s: float = 0.01,
    ) -> None:
        self.engines, self.token_layouts, self.store = list(engines), list(token_layouts), store
        self.on_ready, self.max_batch, self.poll_s = on_ready, max_batch, poll_s
        self.queue: deque[Seq] = deque()
        self.lock = threading.Lock()
        self.timeline: list[Interval] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prompt-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float) -> None:
        self.stopped.set()
        self.thread.join(timeout_s)

    def submit(self, seq: Seq) -> None:
        with self.lock:
            self.queue.append(seq)

    def cancel(self, request_id: str) -> Seq | None:
        with self.lock:
            for seq in self.queue:
                if seq.request_id == request_id:
                    self.queue.remove(seq)
                    return seq
        return None

    @property
    def pending(self) -> int:
        with self.lock:
            return len(self.queue)

    def _run(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                batch = [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]
            if not batch:
                time.sleep(self.poll_s)
                continue
            try:
                first_tokens = self.prefill(batch)
            except Exception as exc:
                log.exception("prefill failed")
                for seq in batch:
                    seq.finish(FinishReason.ERROR, f"prefill failed: {exc}")
                continue
            for seq, token in zip(batch, first_tokens, strict=True):
                self.on_ready(seq, token)

    def prefill(self, batch: list[Seq]) -> list[int]:
        """Run the prompts through every prompt stage; put their KV in the store."""
        start = time.monotonic()
        caches = [[engine.new_cache() for _ in batch] for engine in self.engines]
        x: list[torch.Tensor] = [torch.tensor(s.prompt_ids, dtype=torch.long) for s in batch]
        for engine, stage_caches in zip(self.engines, caches, strict=True):
            x = engine.prefill(x, stage_caches)
        tokens = [int(Sampler(s.sampling)(logits[None])[0]) for s, logits in
                  zip(batch, x, strict=True)]
        for i, seq in enumerate(batch):
            per_stage = regroup([c[i] for c in caches], self.token_layouts, seq.prompt_len)
            for stage_index, cache in enumerate(per_stage):
                self.store.put(seq.seq_id, stage_index, cache)
        self.timeline.append(Interval(start, time.monotonic(), -1, "prefill"))
        return tokens


def stream_prefill(
    engines: Sequence[Engine],
    senders: Sequence[KVSender],
    prompts: Mapping[str, Sequence[int]],
    tickets: Mapping[str, Sequence[bytes]],
    sampling: Mapping[str, SamplingParams] | None = None,
    save_timeout_s: float = 30.0,
) -> dict[str, int]:
    """Prefill ``prompts`` (request id -> ids) on the prompt stages ``engines`` (one
    ``KVSender`` each), streaming every layer's KV while the next computes to the token
    stages that reserved ``tickets[request_id]`` (one ticket per token stage). Returns each
    first token; raises ``KVTransferError`` naming the token stage a transfer failed to."""
    sampling = sampling or {}
    rids = list(prompts)
    x: list[torch.Tensor] = [torch.tensor(prompts[r], dtype=torch.long) for r in rids]
    taken: list[tuple[KVSender, SendHandle]] = []  # every staging block, given back on any exit
    try:
        for engine, sender in zip(engines, senders, strict=True):
            stage_handles = []
            for rid in rids:
                stage_handles.append(sender.start(rid, list(tickets[rid])))
                taken.append((sender, stage_handles[-1]))

            def save(layer: int, caches: Sequence[KVCache], sender=sender,
                     hs=stage_handles) -> None:
                for handle, cache in zip(hs, caches, strict=True):
                    sender.save_layer(handle, layer, cache)

            x = engine.prefill(x, [engine.new_cache() for _ in rids], on_layer=save)
        first = {rid: int(Sampler(sampling.get(rid))(logits[None])[0])
                 for rid, logits in zip(rids, x, strict=True)}
        for sender, handle in taken:
            sender.finish(handle, extra=encode_first_token(first[handle.request_id]))
        for sender, handle in taken:
            sender.wait_for_save(handle, save_timeout_s)
    finally:
        for sender, handle in taken:
            sender.release(handle)
    return first
