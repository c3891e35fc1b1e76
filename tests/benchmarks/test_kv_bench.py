"""``dejavu bench kv --quick`` runs the whole ablation on a tiny model and verifies every mode."""

from __future__ import annotations

import csv

import pytest

from benchmarks.kv import MODES
from orchestrator.cli import main as dejavu


@pytest.mark.slow  # the receiver in a spawned process, over NIXL
@pytest.mark.timeout(180)
def test_quick_bench_writes_verified_results(tmp_path) -> None:
    assert dejavu(["bench", "kv", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "ablation.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == MODES
    assert all(r["verified"] == "True" for r in rows)
    assert all(float(r["prefill_ms"]) > 0 and float(r["nixl_gbps"]) > 0 for r in rows)
    assert float(rows[0]["delta_send_us"]) == 0  # no streaming in the baseline
    assert (tmp_path / "ablation.png").stat().st_size > 0
