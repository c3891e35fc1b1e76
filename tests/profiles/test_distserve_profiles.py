"""The shipped DistServe OPT profiles: they cite their source and match its fitted model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from orchestrator.profiles.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["distserve-opt-13b-a100", "distserve-opt-66b-a100"]
# LLMServe/DistServe simdistserve/estimators/profile_data/profiler-a100-80g.distserve.json
# at 4c68ed9 (unchanged at 82831f1): facebook/opt-66b, TP "4"
OPT66B_TP4 = {
    "decoding_large_small_bs_threshold": 95,
    "prefill": [29.441636037717455, 0.151352180625198, 8.317450765979451e-06],
    "decoding_smallbs": [30.760284619429587, 0.000451947603788462, 0.063284195750671],
    "decoding_largebs": [27.47082137429487, 0.0004046845541646486, 0.12480667738300383],
}


def importer() -> ModuleType:
    path = ROOT / "scripts" / "import_distserve_profiles.py"
    spec = importlib.util.spec_from_file_location("import_distserve_profiles", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SHIPPED)
def test_distserve_profiles_load_and_cite(name):
    p = load_profile(name)
    assert "profiler-a100-80g.distserve.json" in p.source and "Apache" in p.license
    assert "DistServe Authors" in p.license
    assert p.machine.cost_per_hour and p.machine.power_w
    # a prefill grows with its tokens; a step barely grows with the batch (the premise
    # of disaggregation), and grows with the context each sequence holds
    assert list(p.prefill_ms) == sorted(p.prefill_ms)
    assert p.decode_s(64, 512) < 2.5 * p.decode_s(1, 512)
    assert p.decode_s(64, 2048) > p.decode_s(64, 128)
    assert p.max_kv_tokens() > 2048  # at least one full-window sequence fits


def test_opt66b_matches_the_fitted_formula():
    """OPT-66B TP 4, from the coefficients above, in ms:
    prefill 2048 = 29.4416 + 0.151352 x 2048 + 8.31745e-6 x 2048^2 = 374.30;
    step b=1, ctx 512 = 30.7603 + 0.000451948 x 512 + 0.0632842 = 31.055;
    step b=64, ctx 512 = 30.7603 + 0.000451948 x 32768 + 0.0632842 x 64 = 49.620."""
    p = load_profile("distserve-opt-66b-a100")
    assert p.prefill_s(2048) == pytest.approx(0.37430, abs=1e-5)
    assert p.decode_s(1, 512) == pytest.approx(0.031055, abs=1e-5)
    assert p.decode_s(64, 512) == pytest.approx(0.049620, abs=1e-5)
    assert p.kv_bytes_per_token == 2 * 64 * 9216 * 2  # K and V, 64 layers, hidden 9216, fp16
    assert p.machine.accelerators == "4x a100-80gb, TP 4"


def test_the_importer_rebuilds_the_shipped_file():
    module = importer()
    assert module.opt_parameters("opt-66b") == pytest.approx(65.7e9, rel=1e-3)
    assert module.opt_parameters("opt-13b") == pytest.approx(12.85e9, rel=1e-3)
    built = module.build({"facebook/opt-66b": {"4": OPT66B_TP4}}, "opt-66b")
    assert built == load_profile("distserve-opt-66b-a100")
