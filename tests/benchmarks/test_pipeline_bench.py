"""``dejavu bench pipeline --quick`` runs end to end and writes what it says it measured."""

from __future__ import annotations

import csv
import subprocess
from datetime import UTC, datetime, timedelta

from PIL import Image

from orchestrator.cli import main
from orchestrator.cluster.tritonserver import ROOT


def test_quick_bench_writes_table_csv_and_plot(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "pipeline", "--quick", "--requests", "8", "--model", str(tiny_model("gpt2"))]
    assert main([*args, "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "pipeline.csv").open()))
    assert [r["name"] for r in rows] == ["colocated", "disaggregated", "resident", "swapped"]
    for row in rows:
        assert int(row["tokens"]) > 0
        assert 0 < float(row["mean_busy"]) <= 1
        assert int(row["kv_peak_bytes"]) <= int(row["kv_budget_bytes"])
    resident, swapped = rows[2], rows[3]
    assert int(swapped["batch"]) == 2 * int(resident["batch"])  # 4 microbatches, budget 2 x M
    assert (out / "pipeline.png").stat().st_size > 0
    # Provenance: this checkout's commit and today's date on every row and in the figure.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    for row in rows:
        assert head.startswith(row["commit"].removesuffix("-dirty").split("-g")[-1])
        made = datetime.strptime(row["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        assert timedelta(0) <= datetime.now(UTC) - made < timedelta(hours=1)
    assert rows[0]["commit"] in Image.open(out / "pipeline.png").info["Comment"]
    assert "bubble" in capsys.readouterr().out
