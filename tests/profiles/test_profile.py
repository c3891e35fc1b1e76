"""The profile file format and its cost model (pure Python, fast tier)."""

from __future__ import annotations

import json

import pytest

from orchestrator.profiles.profile import EngineProfile, Machine, interpolate, load_profile

SHIPPED = [f"splitwise-{m}-{h}" for m in ("llama2-70b", "bloom-176b") for h in ("a100", "h100")]


def small() -> EngineProfile:
    return EngineProfile(
        name="toy", model="toy", machine=Machine("box", "1x cpu"),
        prefill_tokens=(100, 200, 400), prefill_ms=(10.0, 20.0, 50.0),
        decode_batch=(1, 4), decode_context=(100, 300), decode_ms=((5.0, 7.0), (9.0, 15.0)),
        kv_bytes_per_token=1024, kv_memory_bytes=1 << 20, source="test",
    )


def test_interpolate_holds_below_interpolates_between_extrapolates_past():
    xs, ys = (1.0, 2.0, 4.0), (10.0, 20.0, 30.0)
    assert interpolate(xs, ys, 0.5) == 10.0
    assert interpolate(xs, ys, 2.0) == 20.0
    assert interpolate(xs, ys, 3.0) == 25.0
    assert interpolate(xs, ys, 8.0) == 50.0  # the last segment's slope, 5 per unit
    assert interpolate((1.0,), (7.0,), 9.0) == 7.0


def test_cost_model_reads_the_grid():
    p = small()
    assert p.prefill_s(200) == pytest.approx(0.020)
    assert p.prefill_s(300) == pytest.approx(0.035)
    assert p.decode_s(1, 100) == pytest.approx(0.005)
    assert p.decode_s(4, 300) == pytest.approx(0.015)
    # bilinear: at context 200, batch 1 is 6 ms and batch 4 is 12 ms; batch 2.5 halfway
    assert p.decode_s(2.5, 200) == pytest.approx(0.009)
    assert p.max_kv_tokens() == 1024


def test_round_trip_through_the_file(tmp_path):
    p = small()
    p.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=9), "version"),
        (lambda d: d.update(format="csv"), "format"),
        (lambda d: d["prefill"].update(tokens=[200, 100, 400]), "ascending"),
        (lambda d: d["prefill"].update(ms=[1.0]), "one time per"),
        (lambda d: d["decode"].update(ms=[[1.0], [2.0]]), "grid"),
        (lambda d: d["decode"]["ms"][0].__setitem__(0, -1.0), "positive"),
        (lambda d: d.pop("source"), "malformed"),
    ],
)
def test_bad_files_get_a_clear_error(tmp_path, edit, message):
    d = small().to_dict()
    edit(d)
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message):
        load_profile(tmp_path / "p.json")


def test_bad_queries_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        small().prefill_s(0)
    with pytest.raises(ValueError, match="at least one sequence"):
        small().decode_s(0, 10)
    with pytest.raises(ValueError, match="shipped: .*splitwise-llama2-70b-h100"):
        load_profile("no-such-profile")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_and_cite(name):
    p = load_profile(name)
    assert "perf_model.csv" in p.source and "MIT" in p.license
    assert p.machine.cost_per_hour and p.machine.power_w


def test_splitwise_h100_llama_matches_the_csv():
    """Points read straight from SplitwiseSim's perf_model.csv (TP 8, medians of 5)."""
    h100, a100 = load_profile("splitwise-llama2-70b-h100"), load_profile(
        "splitwise-llama2-70b-a100")
    assert h100.prefill_s(2048) == pytest.approx(0.1344, abs=1e-3)
    assert h100.decode_s(1, 576) == pytest.approx(0.0298, abs=1e-3)
    assert h100.decode_s(64, 576) == pytest.approx(0.0502, abs=1e-3)
    # the premise of disaggregation: a decode step barely grows with the batch
    assert h100.decode_s(64, 576) < 2 * h100.decode_s(1, 576)
    assert a100.prefill_s(2048) > h100.prefill_s(2048)
