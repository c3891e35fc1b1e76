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
    routed_hit_rate,
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
    assert Layout.parse("pools:6:2:kv:decode") == Layout(
        "6P+2T, kv, decode-side reuse", 6, 2, "kv", True, True)
    with pytest.raises(ValueError, match="bad layout"):
        Layout.parse("pools:6:kv")
    with pytest.raises(ValueError, match="bad layout"):
        Layout.parse("colocated:8:kv:decode")  # no T-node receives prompt KV
    got = latencies([[0.0, 1.0, 1.5, 2.5], [1.0, 3.0]])
    assert got["ttft_p50_s"] == pytest.approx(1.5) and got["e2e_p99_s"] == pytest.approx(2.5,
                                                                                          rel=0.2)


def test_routed_caches_send_a_next_turn_where_its_prefix_is_and_split_the_load():
    def cost(new: int, cached: int) -> float:
        return new / 100  # 100 tokens/s, whatever is cached

    # two conversations of two turns, 4-token blocks: each second turn finds its first
    # turn's 8 tokens on the node that prefilled it
    prompts = [[1, 2], [3, 4], [1, 2, 5], [3, 4, 6]]
    lengths = [9, 9, 13, 13]
    assert routed_hit_rate([0, 0, 10, 10], prompts, lengths, 2, 8, 4, cost, 1) == 16 / 44
    # one node: the same hits; no room: none
    assert routed_hit_rate([0, 0, 10, 10], prompts, lengths, 1, 8, 4, cost, 1) == 16 / 44
    assert routed_hit_rate([0, 0, 10, 10], prompts, lengths, 2, 1, 4, cost, 1) < 16 / 44
    # the next turn arrives while its node has more queued than the tokens it would save
    # (weight 1): the other node computes it whole; at weight 2 the saving wins
    busy = [[1, 2], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27],
            [1, 2, 5]]
    lens, at = [9, 33, 33, 13], [0, 0, 0, 0.05]
    assert routed_hit_rate(at, busy, lens, 2, 32, 4, cost, 1) == 0
    assert routed_hit_rate(at, busy, lens, 2, 32, 4, cost, kv_weight=2) == 8 / sum(lens)


def test_predictions_take_each_layouts_measured_hit_rate(tmp_path):
    from argparse import Namespace

    from clients.common import write_csv
    from clients.disagg import Job
    from clients.kv_reuse import Result, predict_from

    def row(name: str, hit_rate: float) -> Result:
        return Result(name, 20, 1.0, 2.0, 50.0, 2.0, 3.0, 80_000, int(80_000 * (1 - hit_rate)),
                      hit_rate, 0.3, hit_rate / 0.3, 0.0, 0)

    write_csv(tmp_path / "kv_reuse.csv", [row("2P+1T, jsq", 0.0), row("2P+1T, kv", 0.5)])
    jobs = [Job([5] * 4000, 8, i * 0.5) for i in range(20)]
    args = Namespace(profile="splitwise-llama2-70b-h100", batch=16)
    jsq, kv = predict_from(tmp_path / "kv_reuse.csv",
                           [Layout.parse("pools:2:1:jsq"), Layout.parse("pools:2:1:kv")], jobs,
                           args)
    assert kv.hit_rate == 0.5 and kv.prefill_tokens == 40_000  # the measured row, read back
    assert 0 < kv.sim_ttft_p50_s < jsq.sim_ttft_p50_s  # half of each prompt cached: faster
    assert kv.sim_vs_measured_p50 == kv.sim_ttft_p50_s / 1.0
    with pytest.raises(ValueError, match="no row"):
        predict_from(tmp_path / "kv_reuse.csv", [Layout.parse("pools:6:2:kv")], jobs, args)
