"""Splitwise's pools: batch cap, JSQ, transfer choice, the mixed pool under a load shift."""

from __future__ import annotations

import pytest

from orchestrator.planner.perf_model import Profile, Workload
from orchestrator.planner.splitwise import (
    Link,
    Pools,
    SplitwiseCluster,
    layerwise_exposed_time,
    layerwise_threshold,
    serialized_transfer_time,
)
from orchestrator.planner.workload import Request, load_trace, poisson, sample

KV_PER_TOKEN = 80 * 2 * 8 * 128 * 2  # Llama-2-70B in fp16: 80 layers, 8 KV heads of 128
# A Llama-2-70B-like machine: 1500-token prompt in 200 ms, 30 ms token steps.
PROFILE = Profile(L=80, W0=1.75e9, C0=KV_PER_TOKEN / 80 * 1500, K0=KV_PER_TOKEN / 80,
                  M=640e9, Y=0.2, t=0.03, m=1.02, workload=Workload(1500, 1, 1))


def code_requests(count: int = 300, rate: float = 12.0, seed: int = 0) -> list[Request]:
    return poisson(sample(load_trace("code"), count, seed), rate, seed)


def test_prompt_batches_are_capped():
    cluster = SplitwiseCluster(PROFILE, Pools(2, 2), prompt_batch_tokens=2048)
    reqs = code_requests()
    cluster.run(reqs)
    longest_prompt = max(r.prompt_len for r in reqs)
    assert max(cluster.prompt_batch_tokens) <= max(2048, longest_prompt)
    assert sum(cluster.prompt_batch_tokens) == sum(r.prompt_len for r in reqs)
    multi = [b for b in cluster.prompt_batch_tokens if b <= 2048]
    assert multi and max(multi) > max(r.prompt_len for r in reqs if r.prompt_len <= 2048) / 2


def test_join_the_shortest_queue_spreads_prompts_under_load():
    """At light load ties go to the first machine; once queues form, JSQ evens them out."""
    cluster = SplitwiseCluster(PROFILE, Pools(4, 4))
    cluster.run(code_requests(rate=40.0))
    busy = [m.busy_seconds for m in cluster.prompt_pool]
    assert min(busy) > 0.9 * max(busy), busy


def test_transfer_mode_follows_the_threshold():
    link = Link(bandwidth=25e9, layerwise_overhead=0.008)
    threshold = layerwise_threshold(PROFILE, link)
    assert 1 < threshold < 10_000
    # Below the crossover serialized exposes less time, above it layer-wise does.
    for prompt_len, layerwise_wins in ((int(threshold * 0.5), False), (int(threshold * 2), True)):
        serialized = serialized_transfer_time(PROFILE, link, prompt_len)
        layerwise = layerwise_exposed_time(PROFILE, link, prompt_len)
        assert (layerwise < serialized) == layerwise_wins
    cluster = SplitwiseCluster(PROFILE, Pools(2, 2), link=link)
    cluster.run(code_requests(100))
    assert {j.layerwise for j in cluster.jobs} == {False, True}
    assert all(j.layerwise == (j.request.prompt_len >= threshold) for j in cluster.jobs)


def test_slow_streaming_never_goes_layerwise():
    slow = Profile(**{**PROFILE.__dict__, "m": 1.9})
    assert layerwise_threshold(slow, Link()) == float("inf")


def test_mixed_pool_absorbs_a_load_shift():
    """Pools sized for long outputs (3 prompt, 5 token) meet the prompt-heavy code trace:
    turning token machines into mixed ones cuts TTFT."""
    reqs = code_requests(400)
    rigid = SplitwiseCluster(PROFILE, Pools(3, 5, 0)).run(reqs)
    mixed = SplitwiseCluster(PROFILE, Pools(3, 4, 1)).run(reqs)
    print(f"TTFT p99: rigid {rigid.ttft.p99:.2f}s, with a mixed machine {mixed.ttft.p99:.2f}s")
    assert mixed.ttft.p99 < 0.75 * rigid.ttft.p99
    assert mixed.ttft.p50 < 0.5 * rigid.ttft.p50


def test_all_mixed_is_the_baseline_and_reports_metrics():
    r = SplitwiseCluster(PROFILE, Pools(0, 0, 4)).run(code_requests(100))
    assert r.requests == 100 and r.makespan > 0
    assert r.ttft.p50 <= r.ttft.p90 <= r.ttft.p99
    assert r.tbt.p50 >= PROFILE.t - 1e-12
    assert 0 < r.utilization <= 1


def test_bad_pools_and_oversized_requests_are_rejected():
    with pytest.raises(ValueError, match="both prompt and token"):
        Pools(2, 0, 0)
    tiny = Profile(**{**PROFILE.__dict__, "M": 80 * 1.75e9 + 1000 * KV_PER_TOKEN})
    with pytest.raises(ValueError, match="more KV than a machine holds"):
        SplitwiseCluster(tiny, Pools(1, 1)).run([Request(0, 0.0, 900, 200)])
