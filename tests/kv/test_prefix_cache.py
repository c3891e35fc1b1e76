"""The prefix cache on its own: chained hashes, salts, hits, LRU within the budget, pins."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.kv.prefix_cache import KVEvent, PrefixCache, block_hashes
from orchestrator.layout import KVCache, KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, max_seq_len=64)
BLOCK = 4


def filled(tokens: list[int], layout: KVLayout = LAYOUT) -> KVCache:
    """A slot whose KV at each position is a function of the prefix up to it (as a model's)."""
    cache = KVCache.empty(layout)
    for pos in range(len(tokens)):
        value = float(hash(tuple(tokens[: pos + 1])) % 1000)
        for layer in layout.layer_range:
            cache.layer(layer)[:, :, pos] = value + layer
    cache.length = len(tokens)
    return cache


def test_hashes_chain_and_name_the_whole_prefix():
    a = block_hashes(list(range(10)), BLOCK)
    assert len(a) == 2  # only whole blocks
    assert block_hashes(list(range(8)) + [99, 98], BLOCK) == a
    changed = block_hashes([7] + list(range(1, 10)), BLOCK)
    assert changed[0] != a[0] and changed[1] != a[1]  # a change early changes every later hash
    assert block_hashes(list(range(4, 8)), BLOCK)[0] != a[1]  # same tokens, other parent


def test_a_salt_changes_every_block():
    plain, salted = block_hashes(list(range(12)), BLOCK), block_hashes(list(range(12)), BLOCK, "t1")
    assert not set(plain) & set(salted)
    assert block_hashes(list(range(12)), BLOCK, "t1") == salted
    assert not set(salted) & set(block_hashes(list(range(12)), BLOCK, "t2"))


def test_a_hit_loads_the_stored_kv_into_a_fresh_slot():
    events: list[KVEvent] = []
    cache = PrefixCache(LAYOUT, BLOCK, capacity_blocks=8, on_event=events.append)
    prompt = list(range(30, 41))  # 11 tokens: 2 whole blocks
    src = filled(prompt)
    assert cache.store(block_hashes(prompt, BLOCK), [src]) == 2
    assert events == [KVEvent("stored", tuple(block_hashes(prompt, BLOCK)))]

    longer = prompt[:9] + [1, 2, 3, 4, 5]  # shares 2 blocks (8 tokens), then differs
    hit = cache.acquire(block_hashes(longer, BLOCK))
    assert hit.tokens == 8
    slot = KVCache.empty(LAYOUT)
    cache.load(hit, [slot])
    assert slot.length == 8
    assert torch.equal(slot.data[:, :, :, :8], src.data[:, :, :, :8])
    assert not slot.data[:, :, :, 8:].any()
    cache.release(hit)
    assert cache.stats.hit_tokens == 8 and cache.stats.lookup_tokens == 12


def test_a_hit_leaves_one_token_to_compute_and_stops_at_the_first_missing_block():
    cache = PrefixCache(LAYOUT, BLOCK, capacity_blocks=8)
    prompt = list(range(8))
    cache.store(block_hashes(prompt, BLOCK), [filled(prompt)])
    assert cache.acquire(block_hashes(prompt, BLOCK), max_tokens=len(prompt) - 1).tokens == 4
    other = [9] * 4 + prompt[4:]
    assert cache.acquire(block_hashes(other, BLOCK)).tokens == 0


def test_slots_of_split_stages_store_and_load_their_own_layers():
    cache = PrefixCache(LAYOUT, BLOCK, capacity_blocks=4)
    prompt = list(range(8))
    whole = filled(prompt)
    first, second = LAYOUT.layers(0, 2), LAYOUT.layers(2, 1)
    parts = [filled(prompt, first), filled(prompt, second)]
    cache.store(block_hashes(prompt, BLOCK), parts)
    hit = cache.acquire(block_hashes(prompt, BLOCK))
    slots = [KVCache.empty(first), KVCache.empty(second)]
    cache.load(hit, slots)
    assert torch.equal(slots[0].data[:, :, :, :8], whole.data[:2, :, :, :8])
    assert torch.equal(slots[1].data[:, :, :, :8], whole.data[2:, :, :, :8])
    with pytest.raises(ValueError, match="slots hold layers"):
        cache.store(block_hashes(prompt, BLOCK), parts[:1])


def test_lru_evicts_unused_blocks_tail_first_and_never_a_held_one():
    events: list[KVEvent] = []
    cache = PrefixCache(LAYOUT, BLOCK, capacity_blocks=3, on_event=events.append)
    a, b = list(range(8)), list(range(100, 108))
    ha, hb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    cache.store(ha, [filled(a)])
    held = cache.acquire(ha)  # a's two blocks are in use
    assert cache.store(hb, [filled(b)]) == 1  # one free block; nothing else may go
    assert set(ha) <= set(cache.in_use()) and hb[0] in cache and hb[1] not in cache
    cache.release(held)
    assert cache.store(hb, [filled(b)]) == 1  # now a's tail goes, a's first block stays
    assert events[-2:] == [KVEvent("removed", (ha[1],)), KVEvent("stored", (hb[1],))]
    assert ha[0] in cache and cache.stats.evicted_blocks == 1


def test_budget_sizes_the_pool_and_refuses_a_budget_below_one_block():
    block_bytes = BLOCK * LAYOUT.step_bytes()
    cache = PrefixCache.within(LAYOUT, BLOCK, budget_bytes=5 * block_bytes + 1)
    assert cache.capacity_blocks == 5 and cache.budget_bytes == 5 * block_bytes
    assert cache.pool.data.numel() * cache.pool.data.element_size() == cache.budget_bytes
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache.within(LAYOUT, BLOCK, budget_bytes=block_bytes - 1)


# -- properties: a replay bigger than the cache -----------------------------------------


PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # few tokens: many shared prefixes
OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "store", "release"]), PROMPTS, st.integers(0, 7)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 6))
def test_memory_stays_in_budget_and_held_blocks_are_never_evicted(ops, capacity):
    removed: set[int] = set()

    def on_event(event: KVEvent) -> None:
        if event.kind == "removed":
            removed.update(event.hashes)
        else:
            removed.difference_update(event.hashes)

    cache = PrefixCache(LAYOUT, BLOCK, capacity, on_event=on_event)
    held: list = []
    contents: dict[int, torch.Tensor] = {}  # what each stored block's KV must stay
    for op, prompt, pick in ops:
        hashes = block_hashes(prompt, BLOCK)
        if op == "store":
            cache.store(hashes, [filled(prompt)])
            for block, h in enumerate(hashes):
                if h in cache:
                    contents.setdefault(h, filled(prompt).data[:, :, :, block * BLOCK:][
                        :, :, :, :BLOCK].clone())
        elif op == "acquire":
            hit = cache.acquire(hashes)
            assert hashes[: len(hit.hashes)] == hit.hashes
            held.append(hit)
        elif held:
            cache.release(held.pop(pick % len(held)))
        assert len(cache) <= capacity and cache.used_bytes <= cache.budget_bytes
        for hit in held:  # held blocks stay, with their own KV
            for h, index in zip(hit.hashes, hit.indices, strict=True):
                assert h in cache and h not in removed
                assert torch.equal(cache.pool.data[index], contents[h])
        for h in list(contents):
            if h not in cache:
                del contents[h]
    for hit in held:
        cache.release(hit)
    assert not cache.in_use()
