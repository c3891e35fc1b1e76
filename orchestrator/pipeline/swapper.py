"""Where a stage keeps its sequences' KV: resident on the device, or swapped per microbatch.

Both placements take device memory only from a :class:`DeviceArena`, a fixed
pool of KV slots inside a byte budget whose own accounting (``used_bytes``,
``peak_bytes``) is what tests and benchmarks read.

Microbatch swapping (DejaVu §4.3): all in-flight KV lives in host memory
(D·M for D microbatches of M bytes); the arena holds 2·M: the microbatch
computing now and the next one, prefetched in the background while this one
computes. After a step only the new positions (the delta) go back to host.
On CUDA the host side is pinned and prefetches run on their own stream.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from orchestrator.layout import KVCache, KVLayout


class ArenaFull(RuntimeError):
    pass


class DeviceArena:
    """A stage's device KV memory: ``budget_bytes // slot_bytes`` slots, allocated up front."""

    def __init__(self, layout: KVLayout, budget_bytes: int, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.slot_bytes = layout.slot_bytes()
        self.budget_bytes = budget_bytes
        self.capacity = budget_bytes // self.slot_bytes
        if self.capacity < 1:
            raise ValueError(
                f"device KV budget {budget_bytes} B holds no slot of {self.slot_bytes} B"
            )
        self._free = [layout.allocate(device) for _ in range(self.capacity)]
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_bytes = 0

    def acquire(self) -> torch.Tensor:
        with self._lock:
            if not self._free:
                raise ArenaFull(
                    f"device KV arena full: {self.capacity} slots of {self.slot_bytes} B "
                    f"in a budget of {self.budget_bytes} B"
                )
            self.used_bytes += self.slot_bytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return self._free.pop()

    def release(self, slot: torch.Tensor) -> None:
        with self._lock:
            self._free.append(slot)
            self.used_bytes -= self.slot_bytes


class KVPlacement(ABC):
    """A stage's KV per sequence; ``open`` hands the engine device caches for one step.
    ``close``, ``prefetch`` and ``shutdown`` do nothing unless the KV moves (swapping)."""

    def __init__(self, arena: DeviceArena) -> None:
        self.arena = arena
        self.layout = arena.layout

    @abstractmethod
    def add(self, seq_id: int, prompt_kv: KVCache | None) -> None:
        """A sequence arrives: with its prompt KV (disaggregated) or empty (prefilled here)."""

    @abstractmethod
    def drop(self, seq_id: int) -> None:
        """The sequence ended: free its KV everywhere."""

    @abstractmethod
    def open(self, microbatch: int, seq_ids: list[int]) -> list[KVCache]:
        """Device caches of ``seq_ids`` for the step about to run."""

    def close(self, microbatch: int, seq_ids: list[int]) -> None:  # noqa: B027 (a no-op)
        """The step is done (its caches grew)."""

    def prefetch(self, microbatch: int, seq_ids: list[int]) -> None:  # noqa: B027 (a no-op)
        """Hint: ``microbatch`` with these sequences runs next."""

    def shutdown(self) -> None:  # noqa: B027 (a no-op)
        """Stop any background copies."""

    @abstractmethod
    def held(self) -> dict[int, KVCache]:
        """Every sequence's KV as it stands between steps (the host copy when swapping)."""

    def rollback(self, lengths: dict[int, int]) -> None:
        """Fault recovery: cut each sequence back to ``lengths[seq_id]`` positions (the state
        before the step to redo); a sequence with no length, or 0, is dropped (redone from
        its prompt). Between steps only: caches are clean."""
        for seq_id, cache in self.held().items():
            length = lengths.get(seq_id, 0)
            if length == 0:
                self.drop(seq_id)
            elif cache.length < length:
                raise RuntimeError(f"sequence {seq_id}: {cache.length} KV positions here, "
                                   f"the resume point needs {length}")
            else:
                self._cut(seq_id, length)

    def cut(self, seq_id: int, length: int) -> None:
        """Keep ``seq_id``'s first ``length`` positions (a re-attached sequence joins)."""
        held = self.held()[seq_id].length
        if held < length:
            raise RuntimeError(f"sequence {seq_id}: {held} KV positions here, {length} needed")
        self._cut(seq_id, length)

    @abstractmethod
    def _cut(self, seq_id: int, length: int) -> None: ...

    @abstractmethod
    def __len__(self) -> int:
        """Sequences held."""

    @abstractmethod
    def __contains__(self, seq_id: int) -> bool: ...


class ResidentKV(KVPlacement):
    """Every sequence's KV stays on the device (no swapping)."""

    def __init__(self, arena: DeviceArena) -> None:
        super().__init__(arena)
        self.caches: dict[int, KVCache] = {}

    def add(self, seq_id: int, prompt_kv: KVCache | None) -> None:
        cache = KVCache(self.layout, self.arena.acquire(), 0)
        if prompt_kv is not None:
            _copy_positions(prompt_kv, cache, 0, prompt_kv.length)
        self.caches[seq_id] = cache

    def drop(self, seq_id: int) -> None:
        self.arena.release(self.caches.pop(seq_id).data)

    def open(self, microbatch: int, seq_ids: list[int]) -> list[KVCache]:
        return [self.caches[s] for s in seq_ids]

    def held(self) -> dict[int, KVCache]:
        return dict(self.caches)

    def _cut(self, seq_id: int, length: int) -> None:
        self.caches[seq_id].length = length

    def __len__(self) -> int:
        return len(self.caches)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.caches


class SwappedKV(KVPlacement):
    """Host memory holds every sequence; the arena holds the open microbatch and the next."""

    def __init__(self, arena: DeviceArena) -> None:
        super().__init__(arena)
        self.host: dict[int, KVCache] = {}
        self.device: dict[int, KVCache] = {}
        self._lock = threading.Lock()  # ``device`` is touched by the prefetch thread too
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._pending: Future | None = None
        self._open: set[int] = set()
        cuda = arena.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(arena.device) if cuda else None
        self.written_back_bytes = 0
        self.prefetched = 0  # sequences already on the device when their step opened
        self.swapped_on_demand = 0

    def add(self, seq_id: int, prompt_kv: KVCache | None) -> None:
        if prompt_kv is None:
            host = KVCache(self.layout, self._host_slot(), 0)
        elif prompt_kv.data.device.type == "cpu" and self._copy_stream is None:
            host = prompt_kv  # already in host memory: adopt it
        else:
            host = KVCache(self.layout, self._host_slot(), 0)
            _copy_positions(prompt_kv, host, 0, prompt_kv.length)
        self.host[seq_id] = host

    def drop(self, seq_id: int) -> None:
        self._settle()
        del self.host[seq_id]
        self._evict([seq_id])

    def open(self, microbatch: int, seq_ids: list[int]) -> list[KVCache]:
        self._settle()
        wanted = set(seq_ids)
        self._evict([s for s in self.device if s not in wanted])
        ready = sum(s in self.device for s in seq_ids)
        self.prefetched += ready
        self.swapped_on_demand += len(seq_ids) - ready
        self._swap_in(seq_ids)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.arena.device).wait_stream(self._copy_stream)
        self._open = wanted
        return [self.device[s] for s in seq_ids]

    def close(self, microbatch: int, seq_ids: list[int]) -> None:
        """Write back only the positions this step added, then give the slots back."""
        for seq_id in seq_ids:
            host, dev = self.host[seq_id], self.device[seq_id]
            self.written_back_bytes += _copy_positions(dev, host, host.length, dev.length)
            host.length = dev.length
        self._open = set()
        self._evict(seq_ids)

    def prefetch(self, microbatch: int, seq_ids: list[int]) -> None:
        self._settle()
        keep = self._open | set(seq_ids)
        self._evict([s for s in self.device if s not in keep])
        todo = [s for s in seq_ids if s in self.host and s not in self.device]
        if todo:
            self._pending = self._prefetcher.submit(self._swap_in, todo)

    def shutdown(self) -> None:
        self._prefetcher.shutdown(wait=True)

    def held(self) -> dict[int, KVCache]:
        self._settle()
        return dict(self.host)

    def _cut(self, seq_id: int, length: int) -> None:
        self._evict([seq_id])  # a device copy would carry the positions being cut
        self.host[seq_id].length = length

    def __len__(self) -> int:
        return len(self.host)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.host

    def _swap_in(self, seq_ids: Iterable[int]) -> None:
        stream = self._copy_stream
        if stream is not None:  # don't overwrite a slot the compute stream may still read
            stream.wait_stream(torch.cuda.current_stream(self.arena.device))
        with torch.cuda.stream(stream):  # a no-op context when ``stream`` is None (CPU)
            for seq_id in seq_ids:
                if seq_id in self.device:
                    continue
                host = self.host[seq_id]
                dev = KVCache(self.layout, self.arena.acquire(), 0)
                _copy_positions(host, dev, 0, host.length)
                dev.length = host.length
                with self._lock:
                    self.device[seq_id] = dev

    def _evict(self, seq_ids: Iterable[int]) -> None:
        """Device copies are clean (written back at ``close``): just free the slots."""
        with self._lock:
            slots = [self.device.pop(s).data for s in list(seq_ids) if s in self.device]
        for slot in slots:
            self.arena.release(slot)

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed prefetch here, on the stage's thread

    def _host_slot(self) -> torch.Tensor:
        slot = self.layout.allocate("cpu")
        return slot.pin_memory() if self._copy_stream is not None else slot


def _copy_positions(src: KVCache, dst: KVCache, start: int, stop: int) -> int:
    """Copy positions ``[start, stop)`` of every layer/head; returns bytes moved."""
    if stop <= start:
        return 0
    view = src.data[:, :, :, start:stop]
    dst.data[:, :, :, start:stop].copy_(view, non_blocking=dst.data.device.type == "cuda")
    dst.length = max(dst.length, stop)
    return view.numel() * view.element_size()


# -- the Appendix E rule ---------------------------------------------------------------


def should_swap(
    new_tokens: int,
    step_time_s: float,
    prompt_len: int,
    batch_size: int,
    token_bytes: int,
    copy_bandwidth: float,
) -> bool:
    """DejaVu Appendix E: swapping (batch 2B instead of B) pays iff
    ``2 N t >= sum_{i=p}^{N+p} max(t, transf_i)``, ``transf_i = i B C / bw``:
    bringing a microbatch of sequences of length ``i`` back takes ``transf_i``
    and hides behind a step of ``t`` only when shorter.
    """
    if new_tokens < 1 or step_time_s <= 0 or copy_bandwidth <= 0:
        raise ValueError("should_swap needs new_tokens >= 1, step time > 0 and bandwidth > 0")
    total = sum(
        max(step_time_s, i * batch_size * token_bytes / copy_bandwidth)
        for i in range(prompt_len, new_tokens + prompt_len + 1)
    )
    return 2 * new_tokens * step_time_s >= total


def measure_copy_bandwidth(device: torch.device, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Host -> device copy bandwidth in bytes/s (pinned host on CUDA), best of ``repeats``."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if cuda else host
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best
