"""scripts/gpu_check.sh --cpu: the prepared GPU check runs end to end, the CPU standing in."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.profiles.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(out)],
                            cwd=ROOT, env=os.environ | {"PYTHON": sys.executable},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(r["token_exact_fp32"] for r in report["exact"].values())
    assert all(0 < r["bf16_agreement"] <= 1 for r in report["exact"].values())
    assert report["streaming"]["receiver_kv_matches"]
    assert report["delta"]["copies_per_step_per_slice"] > 1
    assert all(t["prefill_ms"] > 0 and t["decode_ms_per_step"] > 0
               for t in report["timing"].values())
    swap = report["swap"]
    assert 0 <= swap["overlap_fraction"] <= 1
    assert swap["largest_batch_swapped"] > swap["largest_batch_resident"]
    profile = load_profile(out.with_name("report-profile.json"))  # the emulated engine's input
    assert profile.decode_batch == (1, 4) and all(v > 0 for v in profile.prefill_ms)
