"""``dejavu bench disagg`` at its smallest: every mode comes up pinned, serve a replayed
trace, and the CSV and plot are well-formed (no speed is asserted)."""

from __future__ import annotations

import csv
import math
import os
import re

import pytest

from clients.disagg import COLUMNS, main, make_jobs, scaled_requests


def test_scaled_trace_requests_fit_and_repeat():
    lengths = scaled_requests("code", 5, 1, 0.25, 0.25, max_prompt=100, max_new=8)
    assert len(lengths) == 5 and all(8 <= p <= 100 and 2 <= n <= 8 for p, n in lengths)
    jobs = make_jobs(lengths, 2.0, 50, seed=3)
    assert jobs == make_jobs(lengths, 2.0, 50, seed=3)  # the same requests for every mode
    assert [len(j.prompt_ids) for j in jobs] == [p for p, _ in lengths]
    arrivals = [j.arrival for j in jobs]
    assert arrivals[0] == 0 and arrivals == sorted(set(arrivals))


@pytest.mark.slow
def test_bench_disagg_smallest_run(tiny_model, tmp_path, capsys):
    """Three machines (two of them on one core here: no speed is read): the colocated
    modes are 3 T-nodes and a depth-3 pipeline, the disaggregated one the planner's best
    disaggregated layout of the three (a P-node feeding a depth-2 token pipeline, or
    pools)."""
    out = tmp_path / "out"
    cores = sorted(os.sched_getaffinity(0))
    machines = [f"cpu:{cores[i % len(cores)]}" for i in range(3)]
    argv = ["--model", str(tiny_model("gpt2")), "--requests", "3", "--rates", "4",
            "--max-prompt", "24", "--max-new", "4", "--batch", "2", "--out", str(out),
            "--machines", *machines]
    assert main(argv) == 0, capsys.readouterr().err
    with (out / "disagg.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["colocated", "colocated-pipeline", "disaggregated"]
    assert [r["layout"] for r in rows[:2]] == ["3x colocated", "colocated depth 3"]
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
    assert "| colocated |" in capsys.readouterr().out
