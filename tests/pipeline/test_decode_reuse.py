"""Decode-side reuse: a T-node keeps a finished request's KV (prompt and answer) by block,
and a next turn's prompt KV slot starts with the blocks it holds."""

from __future__ import annotations

import torch

from orchestrator.kv.prefix_cache import PrefixCache
from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.prefix import DecodeReuse

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, max_seq_len=64)
BLOCK = 4


def reuse() -> DecodeReuse:
    return DecodeReuse(PrefixCache(LAYOUT, BLOCK, capacity_blocks=8), b"secret")


def decoded(length: int) -> KVCache:
    """A finished sequence's KV: ``length`` positions, each its own value."""
    cache = KVCache.empty(LAYOUT)
    for pos in range(length):
        cache.data[:, :, :, pos] = float(pos + 1)
    cache.length = length
    return cache


def test_a_finished_request_fills_the_next_turns_slot_with_its_whole_blocks():
    node = reuse()
    tokens = list(range(1, 12))  # 9 prompt tokens and 2 answered: the last one has no KV
    node.keep(tokens, "", decoded(10))
    assert len(node.cache) == 2  # 10 positions: two whole blocks
    slot = KVCache.empty(LAYOUT)
    assert node.fill([*tokens, 50, 51], "")(slot) == 8
    assert torch.equal(slot.data[:, :, :, :8], decoded(10).data[:, :, :, :8])
    assert node.cache.in_use() == {}  # copied: nothing stays held
    assert node.fill([*tokens, 50], "tenant")(KVCache.empty(LAYOUT)) == 0  # another salt
    assert node.fill(tokens[:8], "")(KVCache.empty(LAYOUT)) == 4  # one token left to send
    answer = node.events.since("")
    assert sorted(answer["reset"]) == sorted(node.cache.held_hashes())


def test_a_request_holding_no_kv_here_keeps_nothing():
    node = reuse()
    node.keep(list(range(1, 12)), "", None)
    assert len(node.cache) == 0 and node.events.since("")["reset"] == []
