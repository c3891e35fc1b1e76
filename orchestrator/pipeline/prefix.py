"""Prefill on a node with a prefix cache: load each prompt's cached blocks, compute the rest;
a colocated pipeline's cache, split between its head and its stages
(:class:`PipelinePrefix`); and a T-node's cache of finished requests' KV
(:class:`DecodeReuse`).

A P-node asks :class:`PrefixReuse` before its prompt engines run: each prompt's
leading cached blocks are copied into its (empty) slots, and the engines compute
only the rest, on top (:meth:`~orchestrator.engine.base.Engine.prefill`). After
the prefill, the prompt's whole blocks go into the cache for the next request.
At least one token is always computed: its logits give the first token.

A colocated token pipeline of any depth keeps one source of truth: its head
holds the block index (hashes, salts, LRU, KV events, ``cached_tokens``) with no
KV, and each stage keeps its own layers' KV in a
:class:`~orchestrator.kv.prefix_cache.BlockPool` under the head's block indices.
The step that carries a prompt's first chunk names the blocks each stage loads
into its slot (the chunk starts after them); the step of its last chunk names
the pool indices each stage writes the prompt's new whole blocks to. Those
blocks become findable only once that step came back without an error (every
stage wrote them); a failed step gives its indices back, and a repair drops
the whole index (:meth:`PipelinePrefix.reset`: a replaced stage's pool is
empty), so a hit never names a block a stage lacks. Steps pass each stage in
the order the head sent them, and a stage loads a step's blocks before it
writes any: a block evicted and planned anew is overwritten only after every
earlier step loaded it, so the head holds no block across steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.events import KVEventLog
from orchestrator.kv.prefix_cache import PrefixCache, PrefixHit, StorePlan, block_hashes
from orchestrator.layout import KVCache

log = logging.getLogger(__name__)


@dataclass
class PrefixLoad:
    """One prompt's reuse: its block hashes, the blocks it holds, the tokens left to run."""

    hashes: list[int]
    hit: PrefixHit
    rest: torch.Tensor  # the prompt's ids from the first uncached position

    @property
    def cached_tokens(self) -> int:
        return self.hit.tokens


class PrefixReuse:
    """A node's prefix cache, used around its prefills, and the log of its KV events (what
    a KV-aware router reads)."""

    def __init__(self, cache: PrefixCache, secret: bytes = b"") -> None:
        """``secret``: the cluster's, which signs the events a router reads."""
        self.cache = cache
        self.events = KVEventLog(cache.held_hashes, secret)
        cache.on_event = self.events.record

    def load(self, prompt: Sequence[int], salt: str, slots: Sequence[KVCache]) -> PrefixLoad:
        """Hold ``prompt``'s cached leading blocks (under ``salt``) and copy them into its
        empty ``slots`` (one per stage this node runs). Call :meth:`finish` after."""
        hashes = block_hashes(prompt, self.cache.block_tokens, salt)
        hit = self.cache.acquire(hashes, max_tokens=len(prompt) - 1)
        try:
            self.cache.load(hit, slots)
        except Exception:
            self.cache.release(hit)
            raise
        return PrefixLoad(hashes, hit, torch.tensor(prompt[hit.tokens:], dtype=torch.long))

    def finish(self, load: PrefixLoad, slots: Sequence[KVCache] | None) -> None:
        """Store the prompt's blocks from its prefilled ``slots`` (None: the prefill failed,
        store nothing) and let its held blocks go."""
        try:
            if slots is not None:
                self.cache.store(load.hashes, slots)
        finally:
            self.cache.release(load.hit)


class PipelinePrefix:
    """A colocated pipeline's prefix cache, on its head: the block index of the blocks its
    stages keep (``cache`` keeps no KV), planned per microbatch step, and the log of its KV
    events (what a KV-aware router reads)."""

    def __init__(self, cache: PrefixCache, secret: bytes = b"") -> None:
        """``secret``: the cluster's, which signs the events a router reads."""
        if cache.pool is not None:
            raise ValueError("a pipeline head's index keeps no KV (keep_kv=False)")
        self.cache = cache
        self.events = KVEventLog(cache.held_hashes, secret)
        cache.on_event = self.events.record
        self._storing: dict[int, list[StorePlan]] = {}  # microbatch -> its step's stores

    @property
    def block_tokens(self) -> int:
        return self.cache.block_tokens

    def hit(self, prompt: Sequence[int], salt: str) -> list[int]:
        """The pool indices of ``prompt``'s leading cached blocks (under ``salt``), one token
        at least left to compute: the stages load them with the step this is sent in, ahead
        of any later step's writes (see the module), so nothing is held."""
        hashes = block_hashes(prompt, self.cache.block_tokens, salt)
        hit = self.cache.acquire(hashes, max_tokens=len(prompt) - 1)
        self.cache.release(hit)
        return hit.indices

    def store(self, microbatch: int, prompt: Sequence[int], salt: str) -> list[tuple[int, int]]:
        """(block, pool index) of each whole block of ``prompt`` the index lacks, for the
        stages to write after ``microbatch``'s next step (which runs its last chunk):
        findable once that step is :meth:`answered`."""
        plan = self.cache.plan_store(block_hashes(prompt, self.cache.block_tokens, salt))
        self._storing.setdefault(microbatch, []).append(plan)
        return [(block, index) for block, _, index in plan.blocks]

    def answered(self, microbatch: int) -> None:
        """``microbatch``'s step came back whole: every stage wrote its blocks."""
        for plan in self._storing.pop(microbatch, []):
            self.cache.commit(plan)

    def failed(self, microbatch: int) -> None:
        """``microbatch``'s step failed (or was never answered): its blocks were not kept."""
        for plan in self._storing.pop(microbatch, []):
            self.cache.abandon(plan)

    def reset(self) -> None:
        """A repair: a stage may have been replaced (its pool empty), so drop every block
        (the router hears them removed) and every store under way."""
        for microbatch in list(self._storing):
            self.failed(microbatch)
        self.cache.clear()


class DecodeReuse(PrefixReuse):
    """A T-node's cache of finished requests' KV (prompt and answer), under the same chained
    block hashes as a P-node's: the next turn of a conversation, routed back here, gets its
    leading blocks from it, and the P-node streams only the rest (decode-side reuse).

    A request that ended normally is kept (:meth:`keep`) before its final response goes
    out, so the KV events that response carries name its blocks; a reservation copies the
    cached blocks into its slot (:meth:`fill`)."""

    def __init__(self, cache: PrefixCache, secret: bytes = b"") -> None:
        super().__init__(cache, secret)
        self.on_stored: Callable[[PrefixCache], None] | None = None  # the node's metrics

    def fill(self, prompt: Sequence[int], salt: str) -> Callable[[KVCache], int]:
        """What a prompt KV slot is filled with at reservation: the prompt's cached leading
        blocks (one token at least is left to the P-node, which sends it with the first
        token); returns the positions filled."""
        def fill(slot: KVCache) -> int:
            load = self.load(prompt, salt, [slot])
            self.cache.release(load.hit)  # copied: the blocks may go now
            return load.cached_tokens

        return fill

    def keep(self, tokens: list[int], salt: str, cache: KVCache | None) -> None:
        """Keep the whole blocks of a finished request's KV ``cache`` (None: it holds none
        here), which holds ``tokens`` (prompt and answer; the last one, never fed, has
        none) under ``salt``."""
        if cache is None:
            return
        try:
            hashes = block_hashes(tokens[: cache.length], self.cache.block_tokens, salt)
            if self.cache.store(hashes, [cache]) and self.on_stored is not None:
                self.on_stored(self.cache)
        except Exception:  # soft state: a block not kept is a later miss, never a failure
            log.exception("could not keep a finished request's KV")
