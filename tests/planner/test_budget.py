"""``dejavu plan --budget``: layouts within a cost per hour, on one or two machine types."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.cli import main
from orchestrator.planner import workload as wl
from orchestrator.planner.budget import (
    COST_TIE,
    cost_per_request,
    fleet,
    fleet_total,
    plan_budget,
)
from orchestrator.planner.capacity import Capacity
from orchestrator.planner.planner import Layout, predict_rps
from orchestrator.profiles.profile import Machine, load_profile

A100, H100 = load_profile("splitwise-llama2-70b-a100"), load_profile("splitwise-llama2-70b-h100")
BUDGET = 8 * 4.76  # 8 DGX-H100s' cost per hour, the bench's equal-cost runs (38.08)


def lengths(trace: str, count: int = 300) -> list[tuple[int, int]]:
    return [(r.prompt_len, r.output_len) for r in wl.sample(wl.load_trace(trace), count, 0)]


def test_fleet_and_cost_helpers():
    pools, colocated = Layout.pools(2, 3), Layout(4, 1)
    assert fleet(pools, 5, "a100", "h100") == ["h100"] * 2 + ["a100"] * 3
    assert fleet(pools, 6, "a100", "") == ["a100"] * 6  # one type; idle machines count
    assert fleet(colocated, 4, 2.21, 4.76) == [2.21] * 4  # colocated: no P-nodes
    assert fleet(Layout(2, 2, 3), 10, 1, 9) == [9] * 4 + [1] * 6  # 2x (P2+T3)
    assert fleet_total([4.76, 2.21, 2.21]) == pytest.approx(9.18)
    assert math.isnan(fleet_total([4.76, None]))  # an unknown machine: no undercount
    assert cost_per_request(36.0, 10.0) == pytest.approx(0.001)
    assert math.isnan(cost_per_request(36.0, 0.0))


def test_every_layout_is_within_budget_priced_and_scored_by_the_capacity_model():
    work = lengths("conv")
    result = plan_budget(work, 16, BUDGET, A100, H100)
    one_type = {A100.name: Capacity.of(work, A100, 16), H100.name: Capacity.of(work, H100, 16)}
    mixed = Capacity.of(work, A100, 16, prompt_cost=H100)
    mixes = set()
    for c in result.candidates:
        lay = c.layout
        assert c.cost_per_hour <= BUDGET + 1e-9 and lay.machines <= 64
        prompt_machines = 0 if lay.colocated else lay.replicas * lay.prompt_depth
        price = (prompt_machines * c.prompt.machine.cost_per_hour
                 + (lay.machines - prompt_machines) * c.token.machine.cost_per_hour)
        assert c.cost_per_hour == pytest.approx(price)
        assert c.cost_per_request == pytest.approx(c.cost_per_hour / 3600 / c.rps)
        if c.prompt == c.token:
            capacity = one_type[c.token.name]
        else:  # Splitwise-HA: H100 P-nodes feeding A100 T-nodes, never colocated
            assert (c.prompt, c.token) == (H100, A100) and not lay.colocated
            capacity = mixed
        assert c.rps == pytest.approx(predict_rps(capacity, lay))
        mixes.add(c.mix)
    assert mixes == {"dgx-a100", "dgx-h100", "dgx-h100 P + dgx-a100 T"}
    # Each (layout, machine types) once.
    keys = [(c.layout, c.prompt.name, c.token.name) for c in result.candidates]
    assert len(keys) == len(set(keys))
    # The best by requests/s is no worse than any; by cost per request within the tie.
    assert all(result.best_rps.rps >= c.rps for c in result.candidates)
    cheapest = min(c.cost_per_request for c in result.candidates)
    assert result.best_cost.cost_per_request <= cheapest * (1 + COST_TIE)
    assert all(result.best_cost.rps >= c.rps for c in result.candidates
               if c.cost_per_request <= cheapest * (1 + COST_TIE))


def test_the_equal_cost_splits_found_by_hand():
    """Last session's Splitwise-HA splits within 8 H100s' cost: conversation 2 H100 + 12
    A100 (36.04/h), the mixed mix's best (token-bound: 12 A100 T-nodes); code 6 H100 + 3
    A100 (35.19/h) on the whole trace (prompt-bound: a 4th T-node adds nothing)."""
    conv = plan_budget(lengths("conv"), 16, BUDGET, A100, H100)
    best = {c.mix: c for c in conv.best_per_mix()}["dgx-h100 P + dgx-a100 T"]
    assert (best.layout, best.machines) == (Layout.pools(2, 12), "2 dgx-h100 + 12 dgx-a100")
    assert best.cost_per_hour == pytest.approx(2 * 4.76 + 12 * 2.21)
    whole = [(r.prompt_len, r.output_len) for r in wl.load_trace("code")]
    code = plan_budget(whole, 16, BUDGET, A100, H100)
    best = {c.mix: c for c in code.best_per_mix()}["dgx-h100 P + dgx-a100 T"]
    assert best.layout == Layout.pools(6, 3)
    assert best.cost_per_hour == pytest.approx(6 * 4.76 + 3 * 2.21)


def test_one_machine_type_and_the_bounds():
    work = lengths("code", 100)
    result = plan_budget(work, 8, BUDGET, H100, max_machines=4)
    assert {c.mix for c in result.candidates} == {"dgx-h100"}
    assert max(c.layout.machines for c in result.candidates) == 4
    assert all(c.layout.deepest <= 2 for c in
               plan_budget(work, 8, BUDGET, H100, max_depth=2).candidates)
    same = plan_budget(work, 8, BUDGET, H100, H100, max_machines=4)  # Q = P: one type
    assert same.candidates == result.candidates
    with pytest.raises(ValueError, match="no layout fits"):
        plan_budget(work, 8, 4.0, H100)  # less than one machine
    unpriced = replace(H100, machine=Machine("dgx-h100", "8x h100"))
    with pytest.raises(ValueError, match="no cost per hour"):
        plan_budget(work, 8, BUDGET, unpriced)


def test_plan_budget_cli_prints_the_split(capsys):
    common = ["plan", "--engine-profile", "splitwise-llama2-70b-a100", "--trace", "conv",
              "--requests", "300", "--batch", "16", "--budget", "38.1"]
    assert main([*common, "--prefill-profile", "splitwise-llama2-70b-h100"]) == 0
    out = capsys.readouterr().out
    assert "best per machine mix" in out and "best by cost per request" in out
    row = next(line for line in out.splitlines() if "2 dgx-h100 + 12 dgx-a100" in line)
    assert "2P+12T pools" in row and "36.04" in row
    with pytest.raises(SystemExit) as e:  # the budget needs the capacity model's inputs
        main(["plan", "--engine-profile", "splitwise-llama2-70b-a100", "--budget", "38.1"])
    assert e.value.code == 2 and "--trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a spec has one machine type
        main([*common, "--out", "spec.json"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([*common[:-2], "--prefill-profile", "splitwise-llama2-70b-h100"])
    assert e.value.code == 2 and "--budget" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # without --budget the model is still needed
        main(common[:-2])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err
