"""The capacity model (analytic) against the serving simulator (event-driven), both on one
engine profile; Splitwise's pool layout; no pipeline deeper than the model's layers."""

from __future__ import annotations

import pytest

from orchestrator.engine.config import ModelConfig
from orchestrator.planner import workload as wl
from orchestrator.planner.capacity import Capacity, shared_host_slowdown
from orchestrator.planner.perf_model import Workload, profile_from_config
from orchestrator.planner.planner import Layout, plan, predict_rps
from orchestrator.planner.search import saturating, simulate_serving
from orchestrator.planner.throughput import sustained_rps
from orchestrator.profiles.profile import EngineProfile, Machine, load_profile

LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(1, 2), Layout(1, 4), Layout(1, 1, 1),
           Layout(1, 1, 2), Layout.pools(1, 3), Layout.pools(3, 1)]


def linear_profile() -> EngineProfile:
    """A CPU-like engine: the token step grows linearly with the batch (50 ms a sequence),
    prefill 1 ms a token."""
    return EngineProfile(
        name="linear", model="synthetic", machine=Machine("cpu", "1 core"),
        prefill_tokens=(1.0, 1000.0), prefill_ms=(1.0, 1000.0),
        decode_batch=(1.0, 16.0), decode_context=(1.0, 4096.0),
        decode_ms=((50.0, 50.0), (800.0, 800.0)),
        kv_bytes_per_token=1.0, kv_memory_bytes=1e12, source="synthetic")


def trace_lengths(trace: str, scale: float = 1.0) -> list[tuple[int, int]]:
    picked = wl.sample(wl.load_trace(trace), 300, seed=0)
    return [(max(8, round(r.prompt_len * scale)), max(2, round(r.output_len * scale)))
            for r in picked]


def assert_agree(cost: EngineProfile, lengths: list[tuple[int, int]], batch: int,
                 layouts: list[Layout], within: float = 0.10) -> None:
    capacity = Capacity.of(lengths, cost, batch)
    requests = saturating(lengths, count=1500)
    for layout in layouts:
        predicted = predict_rps(capacity, layout)
        simulated = simulate_serving(cost, requests, layout, batch)
        assert abs(predicted / simulated - 1) <= within, (str(layout), predicted, simulated)


def test_a_linear_step_leaves_no_batching_gain():
    """On a CPU-like profile a T-node serves as many requests/s at batch 1 as at 16 (its
    step grows with the batch); its throughput is batch / step(batch), not one microbatch
    per step time."""
    lengths = [(100, 20)] * 10
    rates = [Capacity.of(lengths, linear_profile(), b).token_rps(1) for b in (1, 4, 16)]
    assert rates == pytest.approx([rates[0]] * 3)
    assert rates[0] == pytest.approx(1 / (19 * 0.05))  # n - 1 steps of 50 ms each
    gpu = load_profile("splitwise-llama2-70b-h100")
    assert Capacity.of(lengths, gpu, 16).token_rps(1) > 8 * Capacity.of(lengths, gpu,
                                                                        1).token_rps(1)


def test_colocated_steps_pay_for_the_prompts_that_join():
    """Colocated depth 1: each step decodes the batch less the joiners and prefills the
    B/n prompts that join (Y + N t would leave the decode of a full batch alone), as one
    mixed step where a prompt joins."""
    cost, lengths = linear_profile(), [(200, 10)] * 10
    capacity = Capacity.of(lengths, cost, 4)
    # 0.4 prompts of 200 ms, 3.6 sequences of 50 ms; a step with a prompt is one mixed step:
    # its token steps ride on the prompt's pass, one step's fixed 50 ms less
    step = 0.4 * 0.2 + 3.6 * 0.05 - 0.4 * 0.05
    assert capacity.colocated_step_s(1) == pytest.approx(step)
    assert capacity.colocated_rps(1) == pytest.approx(4 / (10 * step))


def test_linear_profile_planner_and_simulator_agree():
    assert_agree(linear_profile(), trace_lengths("conv", 0.25), 4, LAYOUTS)


@pytest.mark.parametrize("trace", ["conv", "code"])
def test_h100_profile_planner_and_simulator_agree(trace):
    assert_agree(load_profile("splitwise-llama2-70b-h100"), trace_lengths(trace), 16, LAYOUTS)


def test_kv_memory_caps_the_batch():
    cost = linear_profile()
    lengths = [(100, 20)] * 4
    assert Capacity.of(lengths, cost, 16).slots == 16
    small = Capacity.of(lengths, cost, 16, kv_scale=cost.kv_memory_bytes / (3 * 120))
    assert small.slots == 3  # three sequences of 120 tokens fit


def test_sustained_rate_leaves_out_filling_and_draining():
    """Twenty requests of 2 tokens, one done every second from t=10: 1 req/s in the
    middle, whatever the first and last took."""
    times = [[0.0, 9.5 + i, 10.0 + i] for i in range(20)]
    times[0] = [0.0, 0.5, 1.0]  # an early one
    times[-1] = [0.0, 50.0, 60.0]  # a straggler
    assert sustained_rps(times, [2] * 20) == pytest.approx(1.0, rel=0.1)


def test_pools_layout():
    pools = Layout.pools(2, 6)
    assert (str(pools), pools.machines, pools.token_count) == ("2P+6T pools", 8, 6)
    cost, lengths = linear_profile(), [(100, 20)] * 4
    capacity = Capacity.of(lengths, cost, 4)
    assert predict_rps(capacity, pools) == pytest.approx(
        min(2 * capacity.prompt_rps(), 6 * capacity.token_rps(1)))
    with pytest.raises(ValueError):
        Layout.pools(0, 3)


def test_planner_knows_pools_and_caps_depth_at_the_layers(tiny_model):
    """8 machines, a 4-layer model: pools are candidates, no pipeline is deeper than 4,
    and on a GPU profile with long outputs the planner picks a disaggregated layout whose
    pools serve more than 8 colocated machines."""
    cfg = ModelConfig.from_dir(tiny_model("llama"))
    cost = load_profile("splitwise-llama2-70b-h100")
    lengths = trace_lengths("conv")
    workload = Workload(1000, 200, 16)
    profile = profile_from_config(cfg, workload, 80e9, 0.1, 0.03, 1.0)
    for capacity in (None, Capacity.of(lengths, cost, 16)):
        picked = plan(profile, 8, capacity)
        assert all(s.layout.deepest <= cfg.num_layers for s in picked.candidates)
        assert any(s.layout.is_pools for s in picked.candidates)
    spec = picked.to_spec("model")
    assert spec["machines"] == 8 and picked.model == "capacity"
    colocated = next(s for s in picked.candidates if s.layout == Layout(8, 1))
    assert picked.best.rps >= colocated.rps


def test_mixed_machines_prefill_on_their_own_profile():
    """Splitwise-HA: H100 P-nodes feeding A100 T-nodes. The prompt pool runs at the H100's
    prefill, the token pool at the A100's step; the simulator agrees."""
    h100, a100 = (load_profile(f"splitwise-llama2-70b-{gpu}") for gpu in ("h100", "a100"))
    lengths = trace_lengths("code")
    mixed = Capacity.of(lengths, a100, 16, prompt_cost=h100)
    assert mixed.prompt_rps() == pytest.approx(Capacity.of(lengths, h100, 16).prompt_rps())
    assert mixed.token_rps(1) == pytest.approx(Capacity.of(lengths, a100, 16).token_rps(1))
    requests = saturating(lengths, count=1500)
    for layout in (Layout.pools(3, 2), Layout.pools(6, 4)):
        simulated = simulate_serving(a100, requests, layout, 16, prompt_cost=h100)
        assert predict_rps(mixed, layout) / simulated == pytest.approx(1, abs=0.1), layout


def test_a_shared_host_slows_every_layout_to_the_cores_left_for_its_engines():
    """The serving path's CPU per token (sigma) takes u = r x n x sigma / C of each of C
    cores; engines then compute 1 / (1 - u) slower. The layout's rate on the slowed
    profile is that fixed point, for the planner and the simulator alike."""
    cost, lengths, sigma, cores = linear_profile(), trace_lengths("conv", 0.25), 0.012, 2
    capacity = Capacity.of(lengths, cost, 4)
    tokens = capacity.demand.output
    for layout in (Layout(2, 1), Layout(1, 2), Layout(1, 1, 1)):
        alone = predict_rps(capacity, layout)
        slowdown = shared_host_slowdown(alone, tokens, sigma, cores)
        shared = predict_rps(Capacity.of(lengths, cost.slowed(slowdown), 4), layout)
        assert shared == pytest.approx(alone / slowdown)
        used = shared * tokens * sigma / cores  # of each core, by the serving path
        assert shared == pytest.approx(alone * (1 - used))  # what is left computes
    assert shared_host_slowdown(1.0, 40, 0.0, 2) == 1.0  # a GPU's engines: no share
    with pytest.raises(ValueError):
        shared_host_slowdown(1.0, 40, 0.01, 0)
    with pytest.raises(ValueError):
        cost.slowed(0.5)


def test_a_prefix_hit_rate_shortens_the_prefill_in_the_model_and_the_simulator():
    """The trace's (or a measured) hit rate: each prompt computes only its uncached rest,
    on top of the cached part; both predictions gain on a prefill-bound layout."""
    cost = load_profile("splitwise-llama2-70b-h100")
    lengths = [(8000, 20)] * 50
    cold, warm = (Capacity.of(lengths, cost, batch=16, hit_rate=h) for h in (0.0, 0.5))
    assert warm.demand.prefill_s == pytest.approx(cost.prefill_s(4000, cached=4000))
    assert warm.prompt_rps() > 1.5 * cold.prompt_rps()
    assert cost.reused_prefill_s(100, 1.0) == cost.prefill_s(1, cached=99)
    layout = Layout(replicas=6, prompt_depth=1, token_depth=1, token_pipelines=2)
    requests = [wl.Request(i, i * 0.01, p, n) for i, (p, n) in enumerate(lengths)]
    rps = [simulate_serving(cost, requests, layout, 16, hit_rate=h) for h in (0.0, 0.5)]
    assert rps[1] > rps[0]
    with pytest.raises(ValueError, match="hit rate"):
        cost.reused_prefill_s(10, 1.5)
