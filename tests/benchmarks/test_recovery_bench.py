"""``dejavu bench recovery --quick``: the benchmark runs end to end and writes its outputs."""

from __future__ import annotations

import csv

from benchmarks.recovery import main


def test_bench_recovery_quick(tmp_path) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    for name in ("fig14_summary.csv", "fig14_timeline.csv", "fig15_summary.csv",
                 "fig15_completions.csv", "recovery.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "fig14_summary.csv") as f:
        rows = {row["scenario"]: row for row in csv.DictReader(f)}
    # Recovery resumed mid-run; the restart baseline went back to the prompt.
    assert int(rows["recovery, failure"]["resume_step"]) > 0
    assert int(rows["restart, failure"]["resume_step"]) == 0
    with open(tmp_path / "fig15_completions.csv") as f:
        done = [row["scenario"] for row in csv.DictReader(f)]
    assert done.count("recovery, 3 failures") == done.count("no failure") > 0
