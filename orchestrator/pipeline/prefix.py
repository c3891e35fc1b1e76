"""Prefill on a node with a prefix cache: load each prompt's cached blocks, compute the rest.

The node that prefills (a P-node's prompt stages, a colocated token stage) asks
:class:`PrefixReuse` before its engines run: each prompt's leading cached blocks
are copied into its (empty) slots, and the engines compute only the rest, on top
(:meth:`~orchestrator.engine.base.Engine.prefill`). After the prefill, the
prompt's whole blocks go into the cache for the next request. At least one
token is always computed: its logits give the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.events import KVEventLog
from orchestrator.kv.prefix_cache import PrefixCache, PrefixHit, block_hashes
from orchestrator.layout import KVCache


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
