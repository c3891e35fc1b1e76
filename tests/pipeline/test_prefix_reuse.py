"""A colocated stage's prefix reuse with chunked prompts: a prompt's blocks go into the cache
only once its last chunk ran, under the chained hashes of the whole prompt."""

from __future__ import annotations

import torch

from orchestrator.kv.prefix_cache import PrefixCache, block_hashes
from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.prefix import PrefixReuse

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, max_seq_len=64)
BLOCK = 4
PROMPT = list(range(1, 15))  # 14 tokens: three whole blocks


def reuse() -> PrefixReuse:
    return PrefixReuse(PrefixCache(LAYOUT, BLOCK, capacity_blocks=8), b"secret")


def run_chunk(slot: KVCache, end: int) -> None:
    """As an engine would: the slot grows to ``end`` positions, each its own value."""
    for pos in range(slot.length, end):
        slot.data[:, :, :, pos] = float(pos + 1)
    slot.length = end


def test_a_chunked_prompt_is_stored_whole_after_its_last_chunk():
    node, slot = reuse(), KVCache.empty(LAYOUT)
    for start, end in [(0, 6), (6, 10), (10, 14)]:
        run_chunk(slot, end)
        # a first chunk carries the ids from position 0, later ones their own
        node.ran(7, PROMPT[0 if start == 0 else start:end], "", slot, complete=end == 14)
        assert len(node.cache) == (3 if end == 14 else 0)  # nothing of a partial prompt
    assert sorted(node.cache.held_hashes()) == sorted(block_hashes(PROMPT, BLOCK))
    assert node.cached_tokens(PROMPT, "") == 12 and node.cached_tokens(PROMPT, "salt") == 0
    again = KVCache.empty(LAYOUT)
    load = node.load(PROMPT, "", [again])
    node.finish(load, None)
    assert torch.equal(again.data[:, :, :, :12], slot.data[:, :, :, :12])
    assert load.rest.tolist() == PROMPT[12:]


def test_a_prompt_freed_between_chunks_or_of_unknown_chunks_is_never_stored():
    node, slot = reuse(), KVCache.empty(LAYOUT)
    run_chunk(slot, 8)
    node.ran(1, PROMPT[:8], "", slot, complete=False)
    node.forget(1)  # cancelled: its KV freed
    run_chunk(slot, 14)
    node.ran(1, PROMPT[8:], "", slot, complete=True)  # its first 8 ids are not known here
    assert len(node.cache) == 0
