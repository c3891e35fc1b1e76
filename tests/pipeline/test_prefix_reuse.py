"""A colocated pipeline's prefix cache, split between its head and its stages: the head's
index plans each prompt's blocks, every stage keeps its own layers of them under the same
pool indices, and a block becomes findable only once every stage wrote it."""

from __future__ import annotations

import torch

from orchestrator.kv.prefix_cache import BlockPool, KVEvent, PrefixCache
from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.link import StepMessage
from orchestrator.pipeline.prefix import PipelinePrefix
from orchestrator.pipeline.transport_link import decode, encode

WHOLE = KVLayout(num_layers=4, num_kv_heads=1, head_dim=4, max_seq_len=64)
STAGES = [WHOLE.layers(0, 2), WHOLE.layers(2, 2)]  # two stages, two layers each
BLOCK = 4
PROMPT = list(range(1, 15))  # 14 tokens: three whole blocks


def index(capacity: int = 8, events: list[KVEvent] | None = None) -> PipelinePrefix:
    cache = PrefixCache(STAGES[0], BLOCK, capacity, keep_kv=False,
                        on_event=None if events is None else events.append)
    prefix = PipelinePrefix(cache, b"secret")
    if events is not None:  # the index's own log records too; the test listens beside it
        record = cache.on_event
        cache.on_event = lambda event: (events.append(event), record(event))
    return prefix


def prefilled(layout: KVLayout, seed: int) -> KVCache:
    """A stage's slot after the prompt ran: each position its own values."""
    slot = KVCache.empty(layout)
    slot.data[:, :, :, : len(PROMPT)] = torch.rand(
        slot.data[:, :, :, : len(PROMPT)].shape, generator=torch.Generator().manual_seed(seed))
    slot.length = len(PROMPT)
    return slot


def test_each_stage_keeps_its_layers_under_the_heads_indices_and_loads_them_back():
    prefix = index()
    pools = [BlockPool(layout, BLOCK, 8) for layout in STAGES]
    slots = [prefilled(layout, seed) for seed, layout in enumerate(STAGES)]
    stores = prefix.store(0, PROMPT, "")
    assert [block for block, _ in stores] == [0, 1, 2]
    assert prefix.hit(PROMPT, "") == []  # planned, not yet written everywhere
    for pool, slot in zip(pools, slots, strict=True):
        for block, at in stores:
            pool.write(at, block, slot)
    prefix.answered(0)
    load = prefix.hit(PROMPT, "")
    assert load == [at for _, at in stores]  # the prompt's 3 blocks (one token left over)
    assert prefix.hit(PROMPT[:12], "") == load[:2]  # one token at least is computed
    assert prefix.hit(PROMPT, "tenant-b") == []  # another salt never hits
    for pool, slot, layout in zip(pools, slots, STAGES, strict=True):
        again = KVCache.empty(layout)
        pool.load(load, again)
        assert again.length == 12
        assert torch.equal(again.data[:, :, :, :12], slot.data[:, :, :, :12])


def test_a_failed_step_gives_its_blocks_back_and_a_repair_drops_every_block():
    events: list[KVEvent] = []
    prefix = index(capacity=3, events=events)
    prefix.store(0, PROMPT, "")
    prefix.failed(0)  # a stage never wrote them: never findable, their indices free again
    assert prefix.hit(PROMPT, "") == [] and len(prefix.cache) == 0
    stores = prefix.store(1, PROMPT, "")
    assert len(stores) == 3  # all three indices were given back
    prefix.answered(1)
    assert len(prefix.hit(PROMPT, "")) == 3
    prefix.store(0, PROMPT[:8] + [99] * 6, "")  # a step under way when the repair comes
    prefix.reset()  # a replaced stage's pool is empty: no hit may name a block there
    assert prefix.hit(PROMPT, "") == [] and len(prefix.cache) == 0
    said = {kind: {h for e in events if e.kind == kind for h in e.hashes}
            for kind in ("stored", "removed")}
    assert said["removed"] == said["stored"] and len(said["stored"]) == 3  # the router's view
    assert len(prefix.store(0, PROMPT, "")) == 3  # every index is free again


def test_a_block_evicted_for_a_new_store_is_planned_to_a_used_index_after_its_loads():
    """Capacity 3: a second prompt evicts the first's tail. The index it takes may be one a
    step already sent loads: stages run steps in order, loads before writes."""
    prefix = index(capacity=3)
    prefix.store(0, PROMPT, "")
    prefix.answered(0)
    first = prefix.hit(PROMPT, "")
    other = [50, 51, 52, 53, 54]  # one whole block
    stores = prefix.store(1, other, "")
    assert [at for _, at in stores] == [first[2]]  # one block: the first prompt's tail went
    prefix.answered(1)
    assert prefix.hit(PROMPT, "") == first[:2] and prefix.hit(other, "") == [first[2]]


def test_a_step_carries_its_blocks_to_a_stage_in_another_process():
    message = StepMessage(3, 7, [], None, prompt_seq_ids=[5, 6],
                          prompts=[torch.tensor([1, 2]), torch.tensor([3])],
                          cached_blocks={5: [4, 0]}, store_blocks={5: [(2, 1)], 6: [(0, 3)]})
    out = torch.zeros(1 << 16, dtype=torch.uint8)
    encode(message, out)
    back = decode(out)
    assert back.cached_blocks == message.cached_blocks
    assert back.store_blocks == message.store_blocks
