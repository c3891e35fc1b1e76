"""The pipeline simulator: calibration against the formulas, reproducibility,
the planner vs exhaustive search, and DejaVu Appendix B's trends."""

from __future__ import annotations

import pytest

from orchestrator.planner import formulas as F
from orchestrator.planner.perf_model import Profile, Workload
from orchestrator.planner.planner import Layout, plan
from orchestrator.planner.search import exhaustive, simulate_layout
from orchestrator.planner.simulator import (
    RequestTimes,
    ServingSimulator,
    simulate_colocated,
    simulate_disaggregated,
)
from orchestrator.planner.workload import Request, load_trace, poisson, sample, synthetic
from orchestrator.profiles.profile import load_profile


def profile(Y: float, t: float = 0.01, m: float = 1.0, N: int = 32, M: float = 1e9,
            prompt_len: int = 64, batch: int = 1) -> Profile:
    """Symbolic bytes (L=8, W0=1, C0=K0=0.25): M=8 forces D_p >= 2 and D_t >= 2."""
    return Profile(L=8, W0=1, C0=0.25, K0=0.25, M=M, Y=Y, t=t, m=m,
                   workload=Workload(prompt_len, N, batch))


def per_D_microbatches(makespan: float, microbatches: int, D: int) -> float:
    return makespan / microbatches * D


@pytest.mark.parametrize("ratio", [1.5, 10, 40])
def test_steady_state_matches_the_formulas(ratio):
    """No early stops, saturated: colocated matches I_c, disaggregated I_dis (fill/drain aside)."""
    D, N = 6, 32
    p = profile(Y=ratio * 0.01, m=1.1, N=N)
    reqs = synthetic(48 * D, 64, N)
    colo = simulate_colocated(p, reqs, depth=D)
    assert per_D_microbatches(colo.makespan, len(reqs), D) == pytest.approx(
        F.colocated_inverse_throughput(D, p.Y, p.t, N), rel=0.02)
    s = F.integer_split(D, p.Y, p.t, N, p.m, 1, 1)
    dis = simulate_disaggregated(p, reqs, s.D_p, s.D_t)
    assert per_D_microbatches(dis.makespan, len(reqs), D) == pytest.approx(s.I_dis, rel=0.03)


def test_seeded_simulation_is_reproducible():
    p = profile(Y=0.2, m=1.05, batch=4)
    trace = load_trace("conv")

    def run(seed: int):
        reqs = poisson(sample(trace, 64, seed), rate=20.0, seed=seed)
        return [simulate_layout(p, reqs, lay) for lay in
                (Layout(1, 4), Layout(2, 2), Layout(1, 1, 3))]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other


def test_planner_pick_is_within_5_percent_of_exhaustive_search():
    worst = 0.0
    for D in (4, 6):
        for ratio in (1.5, 6, 30):
            for N in (8, 48):
                for m, M in ((1.0, 1e9), (1.2, 8)):
                    p = profile(Y=ratio * 0.01, m=m, N=N, M=M)
                    search = exhaustive(p, synthetic(16 * D, 64, N), D)
                    chosen = plan(p, D).layout
                    picked = next(r.makespan for lay, r in search if lay == chosen)
                    gap = picked / search[0][1].makespan - 1
                    worst = max(worst, gap)
                    assert gap <= 0.05, (D, ratio, N, m, M, chosen, search[0][0])
    print(f"worst planner gap vs exhaustive: {worst:.2%}")


def _best_makespans(p: Profile, reqs, D: int) -> tuple[float, float]:
    """(best colocated incl. data parallel, best disaggregated) makespans."""
    results = exhaustive(p, reqs, D)
    colo = min(r.makespan for lay, r in results if lay.colocated)
    dis = min(r.makespan for lay, r in results if not lay.colocated)
    return colo, dis


def test_disaggregation_gains_more_as_prompts_grow():
    """Appendix B: same per-token prompt cost, longer prompts -> larger gain.

    Memory forces token and colocated pipelines to depth >= 4 (M=6)."""
    D, gains = 8, []
    for prompt_len in (64, 512, 2048):
        p = profile(Y=prompt_len * 2e-4, t=0.02, m=1.05, N=64, M=6, prompt_len=prompt_len)
        reqs = synthetic(64, prompt_len, 64, early_stops=True, seed=3)
        colo, dis = _best_makespans(p, reqs, D)
        gains.append(colo / dis)
    print("colocated/disaggregated makespan by prompt length:", gains)
    assert gains[0] < gains[1] < gains[2]
    assert gains[2] > 1.2


def test_early_stops_hurt_the_colocated_baseline():
    """Appendix B: early stops open bubbles in colocated pipelines, not in disaggregated ones."""
    D, N, prompt_len = 8, 64, 1024
    p = profile(Y=prompt_len * 2e-4, t=0.02, m=1.05, N=N, M=6, prompt_len=prompt_len)
    per_step = {}
    for early in (False, True):
        reqs = synthetic(64, prompt_len, N, early_stops=early, seed=3)
        steps = sum(r.output_len for r in reqs)
        colo, dis = _best_makespans(p, reqs, D)
        per_step[early] = (colo / steps, dis / steps)
    colo_slowdown = per_step[True][0] / per_step[False][0]
    dis_slowdown = per_step[True][1] / per_step[False][1]
    print(f"seconds per token step, early stops / none: colocated {colo_slowdown:.2f}, "
          f"disaggregated {dis_slowdown:.2f}")
    assert colo_slowdown > 1.3
    assert colo_slowdown > dis_slowdown * 1.2


def test_winner_flips_where_the_planner_says():
    """Sweep Y/t across the threshold: the simulated winner (one depth-D colocated
    pipeline vs the best split) is the planner's integer decision, and the flip
    comes no earlier than the real-valued inequality (rounding only delays it)."""
    D, N, m = 6, 16, 1.2
    threshold = F.disaggregation_threshold(D, m)
    sim_flip = None
    for ratio in (1.1, 1.5, 2, 3, 4, 5, 6, 8, 10, 14, 20):
        p = profile(Y=ratio * 0.01, m=m, N=N)
        reqs = synthetic(32 * D, 64, N)
        split = F.integer_split(D, p.Y, p.t, N, m, 1, 1)
        planner_dis = split.I_dis < F.colocated_inverse_throughput(D, p.Y, p.t, N)
        colo = simulate_colocated(p, reqs, depth=D).makespan
        dis = simulate_disaggregated(p, reqs, split.D_p, split.D_t).makespan
        if abs(colo / dis - 1) > 0.02:  # closer than that is a tie
            assert (dis < colo) == planner_dis, (ratio, colo, dis)
        if dis < colo and sim_flip is None:
            sim_flip = ratio
    assert sim_flip is not None and sim_flip >= threshold
    print(f"threshold {threshold:.2f}, simulated flip at Y/t = {sim_flip}")


def test_engine_profile_times_every_pass_by_its_live_batch_and_context():
    """One cost model: a microbatch's passes cost what the emulated engine would sleep."""
    cost = load_profile("splitwise-llama2-70b-h100")
    reqs = [Request(0, 0.0, 600, 3), Request(1, 0.0, 1000, 5)]  # one stops after 3 tokens
    p = profile(Y=1.0, batch=2)
    colo = simulate_colocated(p, reqs, depth=1, cost=cost)
    steps = [cost.decode_s(2, 800 + k) for k in range(3)] + [
        cost.decode_s(1, 1000 + k) for k in range(3, 5)]
    assert colo.makespan == pytest.approx(cost.prefill_s(1600) + sum(steps))
    dis = simulate_disaggregated(p, reqs, 1, 1, cost=cost)
    assert dis.makespan == pytest.approx(colo.makespan)  # m = 1, nothing else in the way
    assert simulate_colocated(p, reqs, depth=1).makespan != pytest.approx(colo.makespan)


def test_chunked_prefill_keeps_token_steps_short_while_a_long_prompt_runs():
    """Sarathi's trade, as the serving simulator replays it: a 8,000-token prompt joining
    8 running requests stalls their token steps for its whole prefill; in 512-token steps
    each of their gaps is one mixed step, and the long prompt's first token comes later."""
    cost = load_profile("splitwise-llama2-70b-h100")
    reqs = [Request(i, 0.0, 100, 200) for i in range(8)] + [Request(8, 1.0, 8000, 10)]

    def run(chunk: int) -> tuple[float, float, int]:
        times = ServingSimulator(cost, 16, 0, 1, 1, prefill_chunk=chunk).run(reqs)
        worst = max(max(t.tbts()) for t in times[:8])
        return worst, times[8].first_token - 1.0, sum(1 + len(t.tokens) for t in times)

    whole_gap, whole_ttft, whole_tokens = run(0)
    chunk_gap, chunk_ttft, chunk_tokens = run(512)
    assert whole_gap >= cost.prefill_s(8000)
    longest_chunk = max(cost.prefill_s(512, cached=c) for c in range(0, 8000, 8))
    increment = max(cost.decode_increment_s(8, c) for c in range(100, 301))
    assert chunk_gap <= longest_chunk + increment + 1e-9
    assert chunk_gap < whole_gap / 4 and chunk_ttft > whole_ttft
    assert chunk_tokens == whole_tokens == 8 * 200 + 10
    with pytest.raises(ValueError, match="no P-nodes"):
        ServingSimulator(cost, 16, 1, 1, 1, prefill_chunk=512)


@pytest.mark.parametrize("prompt_nodes", [0, 1])
def test_a_step_overhead_lengthens_every_engine_call_by_it(prompt_nodes):
    """The serving path's time per step (scheduling, gRPC, the relay) comes on top of the
    profile's: alone on a node, a request's first token is one call later by it (the
    colocated step that prefills it, or the P-node's prefill) and every later gap too."""
    cost = load_profile("splitwise-llama2-70b-h100")
    reqs = [Request(0, 0.0, 1200, 6)]

    def run(overhead: float) -> RequestTimes:
        return ServingSimulator(cost, 16, prompt_nodes, 1, 1, step_overhead_s=overhead,
                                prefill_chunk=512 if not prompt_nodes else 0).run(reqs)[0]

    bare, slowed = run(0.0), run(0.002)
    prefill_calls = 3 if not prompt_nodes else 1  # 1,200 tokens in 512-token steps: 3
    assert slowed.first_token == pytest.approx(bare.first_token + prefill_calls * 0.002)
    assert slowed.tbts() == pytest.approx([gap + 0.002 for gap in bare.tbts()])
    with pytest.raises(ValueError, match="overhead"):
        ServingSimulator(cost, 16, prompt_nodes, 1, 1, step_overhead_s=-0.001)


def test_a_dispatch_delays_each_prompt_on_its_way_to_a_p_node_and_its_queue_with_it():
    """Disaggregated, the hops before and after a prefill (the T-node's KV ticket, the
    P-node call's way there and back) come on top of the prefill and its queue: a lone
    request's first token is that much later, its later gaps unchanged; two prompts at
    once on one P-node: the second still waits the first's whole prefill (the hops do not
    hold the P-node), both first tokens later by the dispatch alone."""
    cost = load_profile("splitwise-llama2-70b-h100")
    reqs = [Request(0, 0.0, 4000, 6), Request(1, 0.0, 4000, 6)]

    def run(dispatch: float) -> list[RequestTimes]:
        return ServingSimulator(cost, 16, 1, 1, 1, dispatch_s=dispatch).run(reqs)

    bare, dispatched = run(0.0), run(0.05)
    for b, d in zip(bare, dispatched, strict=True):
        assert d.first_token == pytest.approx(b.first_token + 0.05)
    assert dispatched[1].first_token - dispatched[0].first_token == pytest.approx(
        cost.prefill_s(4000))
    assert dispatched[0].tbts() == pytest.approx(bare[0].tbts())
    with pytest.raises(ValueError, match="dispatch"):
        ServingSimulator(cost, 16, 1, 1, 1, dispatch_s=-0.01)
    with pytest.raises(ValueError, match="colocated"):
        ServingSimulator(cost, 16, 0, 1, 1, dispatch_s=0.05)
