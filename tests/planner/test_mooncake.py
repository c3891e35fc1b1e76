"""The Mooncake trace: the shipped window, prompts from block ids, the offline ideal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.kv_reuse import Layout, latencies
from orchestrator.planner.mooncake import (
    BlockTokens,
    TraceRequest,
    ideal_hit_rate,
    load_mooncake,
    lru_hit_rate,
    prompt_tokens,
)


def test_the_shipped_window_replays_at_its_timestamps_scaled():
    whole = load_mooncake()
    assert len(whole) == 3658 and whole[-1].arrival_s < 1200
    window = load_mooncake(start_s=60, window_s=120, rate_scale=2.0)
    assert all(0 <= r.arrival_s < 60 for r in window)  # 120 s of trace, twice as dense
    assert len(window) == sum(60 <= r.arrival_s < 180 for r in whole)
    with pytest.raises(ValueError, match="no request"):
        load_mooncake(start_s=1e6)


def test_equal_block_ids_make_equal_tokens():
    blocks = BlockTokens(vocab_size=100, block=4)
    a = prompt_tokens(TraceRequest(0, 10, 1, (7, 8, 9)), blocks, max_prompt=100)
    b = prompt_tokens(TraceRequest(0, 6, 1, (7, 5)), blocks, max_prompt=100)
    assert len(a) == 10 and len(b) == 6 and a[:4] == b[:4] and a[4:6] != b[4:6]
    assert min(a) >= 3  # no special token
    assert len(prompt_tokens(TraceRequest(0, 10, 1, (7, 8, 9)), blocks, max_prompt=5)) == 5


def test_ideal_and_lru_on_a_known_sequence():
    # capacity 1: LRU keeps the last prefix and misses the repeat of the first; Belady
    # keeps the block used again soonest
    refs, lengths = [(1,), (2,), (1,), (2,)], [5, 5, 5, 5]  # blocks of 4 tokens
    assert lru_hit_rate(refs, lengths, 1, 4) == 0
    assert ideal_hit_rate(refs, lengths, 1, 4) == pytest.approx(4 / 20)
    assert ideal_hit_rate(refs, lengths, 2, 4) == pytest.approx(8 / 20)
    assert ideal_hit_rate([(1, 2)], [8], 10, 4) == 0  # one token at least is computed


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=30),
       st.integers(1, 8))
def test_the_ideal_never_falls_below_lru(prefixes, capacity):
    refs = [tuple(hash(tuple(p[: i + 1])) for i in range(len(p))) for p in prefixes]
    lengths = [4 * len(p) + 1 for p in prefixes]
    assert ideal_hit_rate(refs, lengths, capacity, 4) >= lru_hit_rate(refs, lengths, capacity,
                                                                         4) - 1e-12


def test_layouts_and_latencies():
    assert Layout.parse("colocated:8:round-robin:nocache") == Layout(
        "8 colocated, round-robin, no cache", 0, 8, "round-robin", False)
    assert Layout.parse("pools:6:2:kv").prefilling == 6
    with pytest.raises(ValueError, match="bad layout"):
        Layout.parse("pools:6:kv")
    got = latencies([[0.0, 1.0, 1.5, 2.5], [1.0, 3.0]])
    assert got["ttft_p50_s"] == pytest.approx(1.5) and got["e2e_p99_s"] == pytest.approx(2.5,
                                                                                          rel=0.2)
