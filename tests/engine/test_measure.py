"""``dejavu profile`` measures the torch engine into a profile the emulated engine reads."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.engine.config import ModelConfig
from orchestrator.profiles.profile import load_profile


def test_profile_measures_a_grid_and_writes_the_format(tiny_model, tmp_path, capsys):
    model, out = tiny_model("llama"), tmp_path / "cpu.json"
    assert main(["profile", "--model", str(model), "--prefill-tokens", "8,32",
                 "--batches", "1,4", "--contexts", "8,24", "--reps", "2",
                 "--out", str(out)]) == 0
    p = load_profile(out)
    cfg = ModelConfig.from_dir(model)
    assert p.prefill_tokens == (8, 32) and p.decode_batch == (1, 4)
    assert p.decode_context == (8, 24) and all(v > 0 for row in p.decode_ms for v in row)
    assert p.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert p.kv_memory_bytes > 0 and "torch engine on cpu" in p.source
    assert p.prefill_s(8) == pytest.approx(p.prefill_ms[0] / 1e3)


def test_profile_refuses_zero_reps(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--model", str(tiny_model("llama")), "--reps", "0",
              "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "--reps" in capsys.readouterr().err
