"""The device arena's accounting, delta write-back, and the Appendix E swap rule."""

from __future__ import annotations

import pytest
import torch

from orchestrator.layout import KVCache, KVLayout
from orchestrator.pipeline.swapper import (
    ArenaFull,
    DeviceArena,
    ResidentKV,
    SwappedKV,
    measure_copy_bandwidth,
    should_swap,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, max_seq_len=16)
CPU = torch.device("cpu")


def test_arena_never_hands_out_more_than_its_budget():
    arena = DeviceArena(LAYOUT, 3 * LAYOUT.slot_bytes() + 1, CPU)
    assert arena.capacity == 3
    slots = [arena.acquire() for _ in range(3)]
    assert arena.used_bytes == arena.peak_bytes == 3 * LAYOUT.slot_bytes()
    with pytest.raises(ArenaFull, match="3 slots"):
        arena.acquire()
    arena.release(slots[0])
    assert arena.used_bytes == 2 * LAYOUT.slot_bytes()
    assert arena.peak_bytes == 3 * LAYOUT.slot_bytes()
    with pytest.raises(ValueError, match="holds no slot"):
        DeviceArena(LAYOUT, LAYOUT.slot_bytes() - 1, CPU)


def filled(length: int, value: float) -> KVCache:
    cache = KVCache.empty(LAYOUT)
    cache.data[:, :, :, :length] = value
    cache.length = length
    return cache


def test_swapped_kv_prefetches_and_writes_back_only_the_delta():
    kv = SwappedKV(DeviceArena(LAYOUT, 2 * LAYOUT.slot_bytes(), CPU))  # 2 microbatches of 1
    kv.add(0, filled(5, 1.0))
    kv.add(1, filled(3, 2.0))
    (dev0,) = kv.open(0, [0])
    assert torch.equal(dev0.data[:, :, :, :5], torch.ones_like(dev0.data[:, :, :, :5]))
    kv.prefetch(1, [1])  # in the background while microbatch 0 "computes"
    dev0.data[:, :, :, 5] = 9.0  # the step writes position 5
    dev0.length = 6
    kv.close(0, [0])
    assert kv.written_back_bytes == LAYOUT.token_bytes_per_layer() * LAYOUT.num_layers
    assert kv.host[0].length == 6 and float(kv.host[0].data[0, 0, 0, 5, 0]) == 9.0
    (dev1,) = kv.open(1, [1])
    assert kv.prefetched == 1 and kv.swapped_on_demand == 1  # seq 0 was fetched on demand
    assert dev1.length == 3 and float(dev1.data[1, 1, 1, 2, 3]) == 2.0
    assert kv.arena.peak_bytes <= kv.arena.budget_bytes
    kv.close(1, [1])
    kv.drop(0)
    kv.drop(1)
    assert len(kv) == 0 and kv.arena.used_bytes == 0
    kv.shutdown()


@pytest.mark.parametrize("placement", [ResidentKV, SwappedKV])
def test_rollback_cuts_kv_back_and_drops_what_restarts(placement):
    """Fault recovery: back to the state before the step to redo."""
    kv = placement(DeviceArena(LAYOUT, 3 * LAYOUT.slot_bytes(), CPU))
    for seq_id, length in ((0, 6), (1, 4), (2, 5)):
        kv.add(seq_id, filled(length, float(seq_id)))
    if placement is SwappedKV:
        kv.open(0, [0, 1])  # a device copy of the positions being cut must not survive
        kv.close(0, [0, 1])
        kv.prefetch(1, [0])
    kv.rollback({0: 4, 1: 4})  # 2 is not given: it restarts from its prompt
    held = kv.held()
    assert sorted(held) == [0, 1] and held[0].length == 4 and held[1].length == 4
    assert kv.open(0, [0])[0].length == 4
    kv.close(0, [0])
    with pytest.raises(RuntimeError, match="sequence 1: 4 KV positions here, the resume "
                                           "point needs 5"):
        kv.rollback({0: 4, 1: 5})
    kv.rollback({})
    assert len(kv) == 0 and kv.arena.used_bytes == 0
    kv.shutdown()


@pytest.mark.parametrize("placement", [ResidentKV, SwappedKV])
def test_cut_keeps_one_sequences_first_positions(placement):
    """A re-attached sequence joins: its KV cut to what its client was delivered."""
    kv = placement(DeviceArena(LAYOUT, 2 * LAYOUT.slot_bytes(), CPU))
    kv.add(0, filled(6, 0.0))
    kv.add(1, filled(5, 1.0))
    kv.cut(0, 4)
    assert kv.held()[0].length == 4 and kv.held()[1].length == 5
    with pytest.raises(RuntimeError, match="sequence 1: 5 KV positions here, 6 needed"):
        kv.cut(1, 6)
    kv.shutdown()


def test_should_swap_on_hand_computed_cases():
    # transf_i = i: sum_{i=1}^{3} max(1, i) = 6 > 2*2*1 = 4
    assert not should_swap(2, 1.0, 1, 1, 1, 1.0)
    # transf_i = 2i for i = 2..6: max(10, .) = 10+10+10+10+12 = 52 <= 2*4*10 = 80
    assert should_swap(4, 10.0, 2, 2, 1, 1.0)
    # equality pays: i = 1, 2: max(2, 1) + max(2, 2) = 4 == 2*1*2
    assert should_swap(1, 2.0, 1, 1, 1, 1.0)
    # a long context makes every transfer slower than a step: 2N t can't cover N+1 of them
    assert not should_swap(100, 1e-3, 1000, 8, 1 << 20, 25e9)
    with pytest.raises(ValueError, match="bandwidth"):
        should_swap(1, 1.0, 1, 1, 1, 0.0)


def test_copy_bandwidth_is_measured():
    assert measure_copy_bandwidth(CPU, nbytes=1 << 20) > 0
