"""scripts/paper_figures.py on tiny synthetic `dejavu bench disagg` CSVs: the figures it
writes, the ratios it pairs, and a figure skipped when its rows are absent."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
H100, A100 = 4.76, 2.21  # the Splitwise profiles' cost per hour


@cache
def script() -> ModuleType:
    path = ROOT / "scripts" / "paper_figures.py"
    spec = importlib.util.spec_from_file_location("paper_figures", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def row(mode: str, layout: str, rate: float, tok: float, good: float, cost_h: float,
        token_rps: float = 10.0, **extra: float | str) -> dict:
    """A full-column row (time scale 8); cost per request as the bench writes it."""
    return {"mode": mode, "layout": layout, "rate_rps": rate, "tokens_per_s": tok,
            "token_rps": token_rps, "goodput_rps": good, "ttft_p50_s": 0.1 * rate,
            "ttft_p99_s": 0.3 * rate, "tbt_p50_ms": 33.0, "tbt_p99_ms": 100.0 + rate,
            "tbt_p99_running_ms": 90.0 + rate, "predicted_rps": 10.0, "time_scale": 8.0,
            "cost_per_request": cost_h / 3600 / token_rps,
            "date": "2026-01-01T00:00:00Z", **extra}


def write(path: Path, rows: list[dict]) -> Path:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    conv = write(tmp_path / "run-conv.csv", [
        row("colocated", "8x colocated", 5, 100, 2.0, 8 * H100),
        row("disaggregated", "2P+6T pools", 5, 110, 3.0, 8 * H100),
        row("colocated", "8x colocated", 15, 200, 1.0, 8 * H100),
        row("disaggregated", "2P+6T pools", 15, 180, 2.0, 8 * H100),
        row("disaggregated", "2P H100 + 12T A100", 15, 240, 1.5, 2 * H100 + 12 * A100,
            token_rps=12.0),
    ])
    code = write(tmp_path / "run-code.csv", [
        row("colocated", "8x colocated", 10, 400, 0.5, 8 * H100),
        row("disaggregated", "6P+2T pools", 10, 380, 0.0, 8 * H100),  # goodput 0: 0x
        # a rerun of the pools alone, newer: a hollow marker, not a ratio (no baseline)
    ])
    rerun = write(tmp_path / "rerun-code.csv", [
        row("disaggregated", "6P+2T pools", 10, 390, 0.1, 8 * H100,
            date="2026-02-01T00:00:00Z")])
    # An older file: no time scale, cost or date columns; its trace given on the line.
    pipe = write(tmp_path / "pipe.csv", [
        {"mode": "colocated-pipeline", "layout": "2x colocated depth 4", "rate_rps": 3,
         "tokens_per_s": 50, "goodput_rps": 0.0, "predicted_rps": 6.0},
        {"mode": "disaggregated", "layout": "2x (P1+T3)", "rate_rps": 3,
         "tokens_per_s": 90, "goodput_rps": 0.4, "predicted_rps": 7.0},
    ])
    return {"conv": conv, "code": code, "rerun": rerun, "pipe": pipe}


def test_layout_machines():
    m = script().machines_of
    assert [m("8x colocated"), m("6P+2T pools"), m("2P H100 + 12T A100"), m("2x (P1+T3)"),
            m("2x colocated depth 4"), m("colocated depth 2"), m("1P+1T"), m("what")] == [
        8, 8, 14, 8, 8, 2, 2, None]


def test_ratios_pair_rows_of_one_file_and_rate(runs):
    pf = script()
    rows = pf.read_runs([str(runs["conv"]), str(runs["code"]), str(runs["rerun"]),
                         f"code={runs['pipe']}"])
    got = {(q.kind, q.trace, q.rate_rps, q.layout): q for q in pf.ratios(rows)}
    assert set(got) == {
        ("equal machines", "conv", 5, "2P+6T pools"),
        ("equal machines", "conv", 15, "2P+6T pools"),
        ("equal cost", "conv", 15, "2P H100 + 12T A100"),
        ("equal machines", "code", 10, "6P+2T pools"),  # the rerun has no colocated row
        ("pipeline", "code", 3, "2x (P1+T3)"),
    }
    low = got["equal machines", "conv", 5, "2P+6T pools"]
    assert (low.tokens, low.goodput, low.cost, low.load) == pytest.approx((1.1, 1.5, 1.0, 0.5))
    assert low.tbt_running_p99 == pytest.approx(95 / 95)
    high = got["equal machines", "conv", 15, "2P+6T pools"]
    assert (high.tokens, high.goodput) == pytest.approx((0.9, 2.0))
    mixed = got["equal cost", "conv", 15, "2P H100 + 12T A100"]
    assert (mixed.tokens, mixed.goodput) == pytest.approx((1.2, 1.5))
    assert mixed.cost == pytest.approx((2 * H100 + 12 * A100) / (8 * H100))  # 0.946
    code = got["equal machines", "code", 10, "6P+2T pools"]
    assert code.file == "run-code.csv" and code.tokens == pytest.approx(0.95)
    assert code.goodput == 0.0
    pipe = got["pipeline", "code", 3, "2x (P1+T3)"]
    assert pipe.tokens == pytest.approx(1.8) and math.isnan(pipe.goodput)  # baseline 0
    assert math.isnan(pipe.cost) and pipe.load == pytest.approx(0.5)
    assert pf.dejavu_names(pipe) == "DejaVu-2-6 vs Baseline-8"


def test_main_writes_every_figure(runs, tmp_path, capsys):
    pf = script()
    out = tmp_path / "figures"
    assert pf.main([str(runs["conv"]), str(runs["code"]), str(runs["rerun"]),
                    f"code={runs['pipe']}", "--out", str(out)]) == 0
    names = ["splitwise-fig16-conv.png", "splitwise-fig16-code.png", "splitwise-fig18.png",
             "dejavu-fig12.png"]
    for name in names:
        assert (out / name).stat().st_size > 10_000, name
    printed = capsys.readouterr().out
    assert "rerun-code.csv:2 disaggregated '6P+2T pools' @ 10 req/s" in printed
    assert "DejaVu-2-6 vs Baseline-8" in printed and "skipped" not in printed
    # The rerun draws no line where a file holds both layouts at that rate.
    lines = pf.fig16_lines(pf.fig16_rows(pf.read_runs(
        [str(runs["code"]), str(runs["rerun"])]), "code", 8, 8.0))
    pools = next(v for k, v in lines.items() if "pools" in k)
    assert [r.file for r in pools[0]] == ["run-code.csv"]
    assert [r.file for r in pools[1]] == ["rerun-code.csv"]


def test_absent_rows_skip_their_figure(runs, tmp_path, capsys):
    pf = script()
    out = tmp_path / "figures"
    nameless = write(tmp_path / "other.csv", [row("colocated", "8x colocated", 1, 1, 1, 1)])
    assert pf.main([str(runs["conv"]), str(nameless), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped " + str(nameless) in printed  # no trace in its name
    assert "splitwise-fig16-code.png: skipped" in printed
    assert "dejavu-fig12.png: skipped" in printed
    assert sorted(p.name for p in out.iterdir()) == ["splitwise-fig16-conv.png",
                                                     "splitwise-fig18.png"]
    assert pf.main([str(runs["conv"]), "--check", "--out", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none").exists()
