"""``dejavu bench disagg`` at its smallest: every mode comes up pinned, serve a replayed
trace, and the CSV and plot are well-formed (no speed is asserted)."""

from __future__ import annotations

import csv
import math
import os
import re

import pytest

from clients.common import CpuUse
from clients.disagg import (
    COLUMNS,
    Job,
    Point,
    Pools,
    check_depths,
    given_split,
    main,
    make_jobs,
    per_request,
    prefill_chunk_of,
    rate_between,
    run_modes,
    scaled_requests,
    summarize,
    sustained,
)


def test_scaled_trace_requests_fit_and_repeat():
    lengths = scaled_requests("code", 5, 1, 0.25, 0.25, max_prompt=100, max_new=8)
    assert len(lengths) == 5 and all(8 <= p <= 100 and 2 <= n <= 8 for p, n in lengths)
    jobs = make_jobs(lengths, 2.0, 50, seed=3)
    assert jobs == make_jobs(lengths, 2.0, 50, seed=3)  # the same requests for every mode
    assert [len(j.prompt_ids) for j in jobs] == [p for p, _ in lengths]
    arrivals = [j.arrival for j in jobs]
    assert arrivals[0] == 0 and arrivals == sorted(set(arrivals))


def test_rate_between_reads_the_middle_not_the_edges():
    """100 events/s for 10 s, then a tail of one a second for 50 s (a last long output):
    over the whole span that is 1050/60 = 17.5/s; the 10-90th percentile window keeps
    the saturated middle."""
    steady = [1 + i / 100 for i in range(1000)]
    tail = [11 + i for i in range(50)]
    assert rate_between(steady + tail) == pytest.approx(100, rel=0.02)
    assert (len(steady) + len(tail)) / (tail[-1] - steady[0]) < 20
    assert math.isnan(rate_between([1.0])) and math.isnan(rate_between([2.0, 2.0, 2.0]))


def test_sustained_throughput_on_a_synthetic_run():
    """20 requests of 10 tokens, one sent each 0.1 s, a token each 0.01 s: 100 tok/s and 10
    completions/s in the middle; request 19 cut by the drain (5 of 10 tokens)."""
    jobs = [Job([1, 2], 10, i * 0.1) for i in range(20)]
    times = [[j.arrival] + [j.arrival + 0.01 * (k + 1) for k in range(10)] for j in jobs]
    times[-1] = times[-1][:6]
    met = [i % 2 == 0 for i in range(20)]
    tokens, done, good = sustained(jobs, times, met)
    assert tokens == pytest.approx(100, rel=0.1)
    assert done == pytest.approx(10, rel=0.1)
    assert good == pytest.approx(5, rel=0.25)
    point = summarize("colocated", "2x colocated", 10.0, jobs, times, 1.0, 0.006, 10, 2,
                      12.0, time_scale=4)
    assert point.unfinished == pytest.approx(1 / 20) and point.time_scale == 4
    assert point.token_rps == pytest.approx(point.tokens_per_s / 10)
    assert point.ttft_p50_s == pytest.approx(0.01)
    assert point.tbt_p50_ms == pytest.approx(10)
    assert point.slo_met == pytest.approx(19 / 20)  # the cut one did not finish


def test_cpu_per_token_and_cost_per_request():
    point = Point("disaggregated", "1P+3T pools", 4, 20, 400.0, 4.0, 2.0, 0.0, 0.1, 0.2,
                  30.0, 40.0, 40.0, 1.0, 2.0, 3.0)
    use = CpuUse(wall_s=50, cluster_cpu_s=10, host_busy_cores=0.5, load_avg=1.2, cores=2)
    point = point.with_cpu(use, tokens=5000)
    assert point.cpu_ms_per_token == pytest.approx(2.0)  # 10 CPU s over 5000 tokens
    assert point.cluster_cpu_cores == pytest.approx(0.2) and not point.cpu_bound
    h100, a100 = "splitwise-llama2-70b-h100", "splitwise-llama2-70b-a100"
    priced = per_request(point, [h100] * 4)
    assert priced.cost_per_request == pytest.approx(4 * 4.76 / 3600 / 2.0)  # 2 req/s
    assert priced.energy_per_request_kj == pytest.approx(4 * 10.2 / 2.0)  # 10.2 kW each
    mixed = per_request(point, [h100] + [a100] * 3)  # Splitwise-HA: H100 prompt machine
    assert mixed.cost_per_request == pytest.approx((4.76 + 3 * 2.21) / 3600 / 2.0)
    assert mixed.energy_per_request_kj == pytest.approx((10.2 + 3 * 6.5) / 2.0)
    assert math.isnan(per_request(point, [""] * 4).cost_per_request)


def test_pipelines_deeper_than_the_model_are_refused_before_starting():
    from orchestrator.planner.planner import Layout

    check_depths(["colocated", "disaggregated"], Pools(2, 6), 8, 4)  # no pipeline: fine
    check_depths(["colocated-pipeline"], Layout(1, 1, 3), 4, 4)
    with pytest.raises(ValueError, match="colocated-pipeline needs 8 stages"):
        check_depths(["colocated-pipeline"], Pools(2, 6), 8, 4)
    with pytest.raises(ValueError, match="disaggregated needs 7 stages, the model has 4"):
        check_depths(["colocated", "disaggregated"], Layout(1, 1, 7), 8, 4)


def test_layouts_asked_for_must_cover_the_machines():
    from orchestrator.planner.planner import Layout

    assert given_split(None, None, 8) is None  # the planner's
    assert given_split([6, 2], None, 8) == Layout.pools(6, 2)
    assert str(given_split(None, [2, 1, 3], 8)) == "2x (P1+T3)"  # DejaVu's, as plan prints
    with pytest.raises(ValueError, match="--pools must split the 8 machines"):
        given_split([6, 3], None, 8)
    with pytest.raises(ValueError, match=r"R x \(DP \+ DT\) = 8 machines.*got 6"):
        given_split(None, [2, 1, 2], 8)


def test_chunked_colocated_runs_once_per_budget():
    modes = run_modes(["colocated", "colocated-chunked", "disaggregated"], [512, 2048])
    assert modes == ["colocated", "colocated-chunk512", "colocated-chunk2048", "disaggregated"]
    assert [prefill_chunk_of(m) for m in modes] == [0, 512, 2048, 0]


def test_mixed_pools_are_labelled_with_their_machines():
    """Splitwise-HA's pools name each pool's machine: an all-H100 split of the same counts
    is another layout."""
    assert str(Pools(6, 3)) == "6P+3T pools"
    assert str(Pools(6, 3, ("dgx-h100", "dgx-a100"))) == "6P dgx-h100 + 3T dgx-a100"


@pytest.mark.slow
def test_bench_disagg_smallest_run(tiny_model, tmp_path, capsys):
    """Three machines (two of them on one core here: no speed is read): the colocated
    modes are 3 T-nodes and a depth-3 pipeline, the disaggregated one the planner's best
    disaggregated layout of the three (a P-node feeding a depth-2 token pipeline, or
    pools); the predictions count the serving path's CPU on the engines' cores, measured
    first on the emulated engine."""
    out = tmp_path / "out"
    cores = sorted(os.sched_getaffinity(0))
    machines = [f"cpu:{cores[i % len(cores)]}" for i in range(3)]
    argv = ["--model", str(tiny_model("gpt2")), "--requests", "3", "--rates", "4",
            "--max-prompt", "24", "--max-new", "4", "--batch", "2", "--out", str(out),
            "--machines", *machines, "--serving-cpu-ms", "auto"]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    sigma = re.search(r"the serving path, ([\d.]+) ms of CPU per token", printed)
    assert sigma and float(sigma[1]) > 0  # measured on the emulated engine first
    with (out / "disagg.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["colocated", "colocated-pipeline", "disaggregated"]
    assert [r["layout"] for r in rows[:2]] == ["3x colocated", "1x colocated depth 3"]
    # DejaVu's P-node feeding a token pipeline, or Splitwise's pools of depth-1 nodes
    split = re.fullmatch(r"1x \(P(\d)\+T(\d)\)|(\d)P\+(\d)T pools", rows[2]["layout"])
    assert split, rows[2]["layout"]
    assert sum(int(d) for d in split.groups() if d) == 3, rows[2]["layout"]
    for row in rows:
        assert set(COLUMNS) <= set(row)
        assert int(row["requests"]) == 3 and float(row["rate_rps"]) == 4
        for key in ("tokens_per_s", "requests_per_s", "ttft_p50_s", "predicted_rps",
                    "simulated_rps"):
            assert float(row[key]) > 0 and math.isfinite(float(row[key]))
        assert 0 <= float(row["slo_met"]) <= 1
    assert (out / "disagg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| colocated |" in printed
