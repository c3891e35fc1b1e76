"""Picking the layout from the SLOs (``dejavu plan --slo-ttft --slo-tbt``): the candidates,
DistServe's goodput by bisection in the serving simulator, the pick and its reason."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.planner import workload as wl
from orchestrator.planner.planner import Layout
from orchestrator.planner.slo import SLO, Candidate, candidates, missed, plan_for_slo
from orchestrator.profiles.profile import load_profile

COST = load_profile("splitwise-llama2-70b-h100")


@pytest.fixture(scope="module")
def requests():
    return wl.sample(wl.load_trace("conv"), 150, 0)  # enough to queue at the goodput


def test_the_candidates_are_the_benchs_layouts():
    found = {str(c) for c in candidates(4, (512, 2048), batch=16)}
    assert found == {"4x colocated, whole prompts", "4x colocated, 512-token steps",
                     "4x colocated, 2048-token steps", "1P+3T pools", "2P+2T pools",
                     "3P+1T pools", "2x (P1+T1)", "1x (P1+T3)", "1x (P2+T2)", "1x (P3+T1)"}
    assert "1x (P1+T3)" not in {str(c) for c in candidates(4, (512,), max_depth=2)}
    with pytest.raises(ValueError, match="at least the batch size"):
        candidates(4, (8,), batch=16)


@pytest.mark.parametrize("ttft, tbt, families", [
    # tight TBT (the unloaded step is 29.9 ms): no prompt may share a token step
    (10.0, 0.035, {"Splitwise pools", "DejaVu split"}),
    # balanced: 512-token chunks keep the mixed steps under the bound
    (3.0, 0.045, {"colocated chunked"}),
])
def test_the_pick_has_the_most_goodput_and_meets_its_slos_there(requests, ttft, tbt, families):
    slo = SLO(ttft, tbt)
    result = plan_for_slo(COST, requests, 4, 16, slo, chunks=(512,))
    best = result.best
    assert best.goodput_rps == max(s.goodput_rps for s in result.scored) > 0
    assert best.candidate.family in families
    assert missed(COST, requests, best.candidate, 16, slo, best.goodput_rps)[0] <= 0.1
    reason = result.reason()
    assert str(best.candidate) in reason and "against the best" in reason


def test_slos_are_checked():
    with pytest.raises(ValueError, match="positive"):
        SLO(0.0, 0.05)
    with pytest.raises(ValueError, match="attainment"):
        SLO(1.0, 0.05, 1.5)
    assert str(Candidate(Layout(8, 1), 512)) == "8x colocated, 512-token steps"


def test_plan_cli_prints_the_goodput_table_and_why(capsys):
    assert main(["plan", "--slo-ttft", "3", "--slo-tbt", "0.045", "--engine-profile",
                 "splitwise-llama2-70b-h100", "--trace", "conv", "--machines", "2",
                 "--requests", "30", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "serves the most within TTFT <= 3 s" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--slo-ttft", "3", "--engine-profile", "splitwise-llama2-70b-h100",
              "--trace", "conv"])
    assert e.value.code == 2 and "go together" in capsys.readouterr().err
