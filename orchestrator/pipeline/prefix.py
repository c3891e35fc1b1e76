"""Prefill on a node with a prefix cache: load each prompt's cached blocks, compute the rest;
and a T-node's cache of finished requests' KV (:class:`DecodeReuse`).

The node that prefills (a P-node's prompt stages, a colocated token stage) asks
:class:`PrefixReuse` before its engines run: each prompt's leading cached blocks
are copied into its (empty) slots, and the engines compute only the rest, on top
(:meth:`~orchestrator.engine.base.Engine.prefill`). After the prefill, the
prompt's whole blocks go into the cache for the next request. At least one
token is always computed: its logits give the first token.

Colocated with chunked prefill, a prompt's first chunk starts after the blocks
the cache held when it was scheduled (:meth:`PrefixReuse.cached_tokens`) and
carries the prompt's ids from position 0: the stage loads what the cache still
holds and computes the rest. Its blocks are stored only after its last chunk
(:meth:`PrefixReuse.ran`), with the chained hashes of the whole prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.events import KVEventLog
from orchestrator.kv.prefix_cache import PrefixCache, PrefixHit, block_hashes
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
        # Colocated: seq id -> the ids from position 0 of a prompt whose last chunk is to come
        self._prompts: dict[int, list[int]] = {}

    def cached_tokens(self, prompt: Sequence[int], salt: str) -> int:
        """The leading positions of ``prompt`` (under ``salt``) the cache holds now, one
        token at least left to compute; nothing is held (a later :meth:`load` may find
        fewer or more)."""
        hashes = block_hashes(prompt, self.cache.block_tokens, salt)
        return self.cache.cached_tokens(hashes, max_tokens=len(prompt) - 1)

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

    def ran(self, seq_id: int, ids: Sequence[int], salt: str, slot: KVCache,
            complete: bool) -> None:
        """A colocated prompt chunk of ``ids`` ran into ``slot`` (a first chunk: the ids
        from position 0). Once ``complete`` (the prompt's last chunk), the whole prompt's
        blocks are stored; until then its ids so far are kept (:meth:`forget` drops them)."""
        so_far = self._prompts.pop(seq_id, [])[: slot.length - len(ids)] + list(ids)
        if len(so_far) != slot.length:  # its earlier chunks unknown here: hashes would lie
            log.warning("prompt %d holds %d positions, %d ids known: not cached", seq_id,
                        slot.length, len(so_far))
        elif complete:
            self.cache.store(block_hashes(so_far, self.cache.block_tokens, salt), [slot])
        else:
            self._prompts[seq_id] = so_far

    def forget(self, seq_id: int) -> None:
        """A sequence's KV is freed: drop its prompt's ids if its last chunk never ran."""
        self._prompts.pop(seq_id, None)


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
