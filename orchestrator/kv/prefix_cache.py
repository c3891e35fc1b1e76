"""The prefix cache: prompt KV kept by block, found again by the blocks' chained hashes.

A prompt is cut into blocks of ``block_tokens`` tokens (only whole blocks are
kept). Block ``i``'s hash is a hash of block ``i - 1``'s hash and block ``i``'s
tokens (as vLLM and Dynamo chain theirs), so one hash names a whole prefix and
two prompts share block ``i`` only if they share every token up to its end.
A per-request *salt* seeds the first block's parent: prompts under different
salts never share a block (prefix caches leak prompts across tenants through
timing otherwise; vLLM's ``cache_salt``).

The cache holds at most ``capacity_blocks`` blocks in one pool allocated up
front, so its memory is bounded by construction (the node's stated budget).
A block in use (acquired by a request being prefilled) is never evicted; the
others go least recently used first, and a prefix's last blocks before its
first ones (a hit needs every block from the first, so a lone parent is worth
more than a lone child). Stored and removed blocks are reported as
:class:`KVEvent` to a listener (the frontend's KV-aware router indexes them).

The KV itself is a :class:`BlockPool` (blocks by index). A colocated token
pipeline splits the two: its head keeps the index without KV (``keep_kv=False``)
and plans each store (:meth:`PrefixCache.plan_store`, then :meth:`~PrefixCache.commit`
once every stage wrote it), and each stage keeps its own layers' blocks in a
pool under the head's block indices.

Soft state: a lost cache loses hits, never a request.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.layout import KVCache, KVLayout

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK_TOKENS = 32
_HASH_BYTES = 8


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str = "") -> int:
    """The parent hash of a prompt's first block under ``salt`` ("" is no salt)."""
    return _digest(b"dejavu-prefix-v1\0", salt.encode())


def block_hashes(tokens: Sequence[int], block_tokens: int, salt: str = "") -> list[int]:
    """The chained hash of each whole block of ``tokens`` (64-bit; tokens as u32 LE)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    parent, hashes = salt_root(salt), []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = struct.pack(f"<{block_tokens}I", *tokens[start : start + block_tokens])
        parent = _digest(parent.to_bytes(_HASH_BYTES, "little"), block)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KVEvent:
    """Blocks a node's cache stored or removed (the router's index follows these)."""

    kind: str  # "stored" | "removed"
    hashes: tuple[int, ...]


@dataclass
class CacheStats:
    """Counters since start: what ``/metrics`` reports."""

    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, found cached
    stored_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def blocks_within(layout: KVLayout, block_tokens: int, budget_bytes: int) -> int:
    """The blocks of ``block_tokens`` tokens of ``layout``'s layers that ``budget_bytes``
    holds (at least one, else ValueError)."""
    block = block_tokens * layout.step_bytes()
    if budget_bytes < block:
        raise ValueError(f"a budget of {budget_bytes} bytes holds no block of "
                         f"{block_tokens} tokens ({block} bytes)")
    return budget_bytes // block


@dataclass(frozen=True)
class StorePlan:
    """Blocks of one prompt to keep: (block in the prompt, its hash, its pool index) each, the
    indices taken (evicting as needed) and not yet findable until :meth:`PrefixCache.commit`;
    ``hashes``: the prompt's blocks it covers, held or planned (used together on commit)."""

    hashes: list[int]
    blocks: list[tuple[int, int, int]]


class BlockPool:
    """The KV of ``capacity_blocks`` blocks of the layers ``layout`` holds, in one tensor
    allocated up front; which block holds what is its owner's to know."""

    def __init__(self, layout: KVLayout, block_tokens: int, capacity_blocks: int,
                 device: str | torch.device = "cpu") -> None:
        import torch

        self.layout, self.block_tokens, self.capacity_blocks = layout, block_tokens, capacity_blocks
        shape = (capacity_blocks, layout.num_layers, 2, layout.num_kv_heads, block_tokens,
                 layout.head_dim)
        # empty: on CPU its pages are taken only as blocks are written
        self.data = torch.empty(shape, dtype=layout.torch_dtype, device=device)

    def load(self, indices: Sequence[int], cache: KVCache) -> None:
        """Copy blocks ``indices`` (a prompt's first blocks, in order) into the empty slot
        ``cache``, whose layers this pool holds; its length becomes theirs."""
        if cache.length:
            raise ValueError(f"a prefix loads into an empty slot; it holds {cache.length}")
        rows = self._layer_rows(cache.layout)
        for block, index in enumerate(indices):
            start = block * self.block_tokens
            cache.data[:, :, :, start : start + self.block_tokens] = self.data[index, rows]
        cache.length = len(indices) * self.block_tokens

    def write(self, index: int, block: int, cache: KVCache) -> None:
        """Keep block ``block`` of the slot ``cache`` (its layers) at ``index``."""
        start = block * self.block_tokens
        if cache.length < start + self.block_tokens:
            raise ValueError(f"block {block} is not whole in a slot of {cache.length} positions")
        rows = self._layer_rows(cache.layout)
        self.data[index, rows] = cache.data[:, :, :, start : start + self.block_tokens]

    def _layer_rows(self, layout: KVLayout) -> slice:
        mine = self.layout
        if (layout.num_kv_heads, layout.head_dim, layout.dtype) != (
                mine.num_kv_heads, mine.head_dim, mine.dtype):
            raise ValueError(f"slot layout {layout} does not match the cache's {mine}")
        first = layout.first_layer - mine.first_layer
        if first < 0 or first + layout.num_layers > mine.num_layers:
            raise ValueError(f"slot layers {list(layout.layer_range)} outside the cache's "
                             f"{list(mine.layer_range)}")
        return slice(first, first + layout.num_layers)


@dataclass
class _Block:
    index: int  # in the pool
    refs: int = 0


@dataclass
class PrefixHit:
    """The leading blocks of one prompt found cached, held until :meth:`PrefixCache.release`."""

    hashes: list[int]
    indices: list[int]
    block_tokens: int
    released: bool = field(default=False, repr=False)

    @property
    def tokens(self) -> int:
        return len(self.hashes) * self.block_tokens


class PrefixCache:
    """Block-granular prompt KV of the layers ``layout`` holds, within ``capacity_blocks``.
    ``keep_kv=False``: the index only (a pipeline head's; its stages keep the KV)."""

    def __init__(
        self,
        layout: KVLayout,
        block_tokens: int,
        capacity_blocks: int,
        device: str | torch.device = "cpu",
        on_event: Callable[[KVEvent], None] | None = None,
        keep_kv: bool = True,
    ) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError(f"need block_tokens >= 1 and capacity_blocks >= 1, got "
                             f"{block_tokens} and {capacity_blocks}")
        self.layout, self.block_tokens, self.capacity_blocks = layout, block_tokens, capacity_blocks
        self.pool = BlockPool(layout, block_tokens, capacity_blocks, device) if keep_kv else None
        self.on_event = on_event
        self.stats = CacheStats()
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # oldest use first
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @classmethod
    def within(cls, layout: KVLayout, block_tokens: int, budget_bytes: int,
               device: str | torch.device = "cpu",
               on_event: Callable[[KVEvent], None] | None = None) -> PrefixCache:
        """As many blocks as ``budget_bytes`` holds (at least one)."""
        return cls(layout, block_tokens, blocks_within(layout, block_tokens, budget_bytes),
                   device, on_event)

    # -- sizes ----------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.layout.step_bytes()

    @property
    def budget_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def held_hashes(self) -> list[int]:
        with self._lock:
            return list(self._blocks)

    def in_use(self) -> dict[int, int]:
        """Hash -> references, for every block a request holds."""
        with self._lock:
            return {h: b.refs for h, b in self._blocks.items() if b.refs}

    # -- a request's prefix ---------------------------------------------------

    def acquire(self, hashes: Sequence[int], max_tokens: int | None = None) -> PrefixHit:
        """Hold the longest cached run of ``hashes`` from the first block (at most
        ``max_tokens`` tokens: a prefill must compute one token at least)."""
        with self._lock:
            found = self._cached_run(hashes, max_tokens)
            for h in found:
                self._blocks[h].refs += 1
            self._touch(found)
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(hashes) * self.block_tokens
            self.stats.hit_tokens += len(found) * self.block_tokens
            return PrefixHit(found, [self._blocks[h].index for h in found], self.block_tokens)

    def cached_tokens(self, hashes: Sequence[int], max_tokens: int | None = None) -> int:
        """The tokens :meth:`acquire` would hold now; holds nothing and counts no lookup."""
        with self._lock:
            return len(self._cached_run(hashes, max_tokens)) * self.block_tokens

    def load(self, hit: PrefixHit, caches: Sequence[KVCache]) -> None:
        """Copy the hit's KV into the (empty) slots ``caches``, each holding some of this
        cache's layers; each slot's length becomes the hit's tokens."""
        if hit.released:
            raise ValueError("the hit was released")
        for cache in caches:
            self._kv().load(hit.indices, cache)

    def release(self, hit: PrefixHit) -> None:
        with self._lock:
            if hit.released:
                return
            hit.released = True
            for h in hit.hashes:
                self._blocks[h].refs -= 1

    def store(self, hashes: Sequence[int], caches: Sequence[KVCache]) -> int:
        """Keep every block of ``hashes`` the slots ``caches`` (together: all of this cache's
        layers) hold in full and the cache lacks, evicting unused blocks as it must; stops
        at the first block it has no room for. Returns the blocks newly stored."""
        pool = self._kv()
        held = min((c.length for c in caches), default=0) // self.block_tokens
        covered = sorted(layer for c in caches for layer in c.layout.layer_range)
        if covered != list(self.layout.layer_range):
            raise ValueError(f"slots hold layers {covered}, the cache "
                             f"{list(self.layout.layer_range)}")
        plan = self.plan_store(hashes[:held])
        try:
            for block, _, index in plan.blocks:
                for cache in caches:
                    pool.write(index, block, cache)
        except BaseException:
            self.abandon(plan)
            raise
        return self.commit(plan)

    def plan_store(self, hashes: Sequence[int]) -> StorePlan:
        """Take a pool index for each block of ``hashes`` the cache lacks, evicting unused
        blocks as it must (stops at the first block it has no room for): the blocks to
        write there, findable only once :meth:`commit` ted (:meth:`abandon`: never)."""
        planned: list[tuple[int, int, int]] = []
        evicted: list[int] = []
        covered = 0
        with self._lock:
            pinned: list[int] = []  # this prompt's blocks stay while its later ones go in
            try:
                for block, h in enumerate(hashes):
                    if h in self._blocks:
                        self._blocks[h].refs += 1
                        pinned.append(h)
                    elif (index := self._take(evicted)) is not None:
                        planned.append((block, h, index))
                    else:
                        break
                    covered += 1
            finally:
                for h in pinned:
                    self._blocks[h].refs -= 1
                self._touch(pinned)
        self._emit("removed", evicted)
        return StorePlan(list(hashes[:covered]), planned)

    def commit(self, plan: StorePlan) -> int:
        """The planned blocks are written: findable from now on (one stored meanwhile under
        the same hash keeps its index, the plan's goes back). Returns the blocks stored."""
        stored: list[int] = []
        with self._lock:
            for _, h, index in plan.blocks:
                if h in self._blocks:
                    self._free.append(index)
                else:
                    self._blocks[h] = _Block(index)
                    stored.append(h)
            self._touch([h for h in plan.hashes if h in self._blocks])
            self.stats.stored_blocks += len(stored)
        self._emit("stored", stored)
        return len(stored)

    def abandon(self, plan: StorePlan) -> None:
        """The planned blocks were not written: their indices go back."""
        with self._lock:
            self._free.extend(index for _, _, index in plan.blocks)

    def clear(self) -> None:
        """Drop every block no request holds."""
        with self._lock:
            gone = [h for h, b in self._blocks.items() if not b.refs]
            for h in gone:
                self._free.append(self._blocks.pop(h).index)
        self._emit("removed", gone)

    # -- inside ---------------------------------------------------------------

    def _cached_run(self, hashes: Sequence[int], max_tokens: int | None) -> list[int]:
        """The longest run of ``hashes`` held from the first block, within ``max_tokens``
        (under the lock)."""
        limit = len(hashes) if max_tokens is None else min(len(hashes),
                                                           max_tokens // self.block_tokens)
        found: list[int] = []
        for h in hashes[:limit]:
            if h not in self._blocks:
                break
            found.append(h)
        return found

    def _touch(self, hashes: list[int]) -> None:
        """Most recently used: the last block first, so a prefix's tail is evicted first."""
        for h in reversed(hashes):
            self._blocks.move_to_end(h)

    def _take(self, evicted: list[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for h, block in self._blocks.items():  # least recently used first
            if not block.refs:
                del self._blocks[h]
                evicted.append(h)
                self.stats.evicted_blocks += 1
                return block.index
        return None

    def _kv(self) -> BlockPool:
        if self.pool is None:
            raise ValueError("this cache keeps no KV (a pipeline head's index)")
        return self.pool

    def _emit(self, kind: str, hashes: list[int]) -> None:
        if hashes and self.on_event is not None:
            self.on_event(KVEvent(kind, tuple(hashes)))
