"""Picking the layout from the SLOs (``dejavu plan --slo-ttft --slo-tbt``): the candidates,
DistServe's goodput by bisection in the serving simulator, the pick and its reason."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.planner import workload as wl
from orchestrator.planner.capacity import Capacity
from orchestrator.planner.planner import Layout, predict_rps
from orchestrator.planner.simulator import RequestTimes
from orchestrator.planner.slo import (
    SLO,
    Candidate,
    SplitwiseSLO,
    candidates,
    highest_rate,
    missed,
    plan_for_slo,
    simulate,
    splitwise_goodput,
)
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


def test_highest_rate_bisects_to_the_edge():
    lo, hi = highest_rate(lambda rate: rate <= 3.0, 10.0, steps=12)
    assert lo <= 3.0 < hi and hi - lo < 0.01
    assert highest_rate(lambda rate: True, 10.0) == (10.0, 10.0)
    assert highest_rate(lambda rate: False, 10.0)[0] == 0.0


def unloaded_times(request: wl.Request, stretch_last: float = 1.0) -> RequestTimes:
    """``request`` served as on an idle machine, its last gap ``stretch_last`` x a step."""
    first = request.arrival + COST.prefill_s(request.prompt_len)
    step = COST.decode_s(1, request.prompt_len + request.output_len / 2)
    gaps = [step] * (request.output_len - 2) + [step * stretch_last]
    tokens = [first + sum(gaps[:i + 1]) for i in range(len(gaps))]
    return RequestTimes(request, first, tokens)


def test_splitwise_slos_judge_the_run_by_percentiles_of_slowdowns():
    runs = [wl.Request(i, float(i), 500, 100) for i in range(20)]
    judge = SplitwiseSLO()
    assert judge.misses(COST, [unloaded_times(r) for r in runs]) == []
    # one gap in 99 per request 8x a step: past TBT P99's 5x, within P50 and P90
    slow = judge.misses(COST, [unloaded_times(r, stretch_last=8.0) for r in runs])
    assert [m.split()[:2] for m in slow] == [["TBT", "P99"]]
    late = [RequestTimes(t.request, t.first_token + 2.0, [s + 2.0 for s in t.tokens])
            for t in map(unloaded_times, runs)]  # every first token 2 s late
    assert {m.split()[0] for m in judge.misses(COST, late)} == {"TTFT", "E2E"}


def test_splitwise_goodput_is_a_rate_where_the_run_meets_all_nine(requests):
    few = requests[:60]
    pools = Candidate(Layout.pools(1, 3))
    rate = splitwise_goodput(COST, few, pools, 16, high=50.0, steps=6)
    assert 0 < rate < 50
    assert SplitwiseSLO().misses(COST, simulate(COST, wl.poisson(few, rate, 0), pools, 16)) == []


def test_goodput_stops_at_what_the_layout_sustains(requests):
    # Loose SLOs: a 150-request replay above capacity would still meet them (it ends
    # before the queue grows); the goodput is the capacity model's rate, limited there.
    result = plan_for_slo(COST, requests, 4, 16, SLO(60.0, 0.5), chunks=(512,))
    capacity = Capacity.of([(r.prompt_len, r.output_len) for r in requests], COST, 16)
    for scored in result.scored:
        assert scored.goodput_rps == pytest.approx(predict_rps(capacity, scored.candidate.layout))
        assert scored.limit == "throughput"
    assert "limited by its throughput" in result.reason()
