"""``dejavu bench serving --breakdown``'s layers, each timed for real: the in-process ones
here, the whole tool against a real cluster in the slow tier."""

from __future__ import annotations

import csv

import pytest

from clients.breakdown import LAYERS, measure_hop, time_engine, time_pipeline
from clients.perf import main
from orchestrator.engine.torch_engine import load_engine
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig

TOKENS = 6


def test_engine_and_pipeline_layers_time_every_token(tiny_model):
    engine = load_engine(tiny_model("llama"))
    prompt = [5, 6, 7, 8]
    assert len(time_engine(engine, prompt, TOKENS)) == TOKENS + 1  # the start, then each token
    with LocalPipeline([engine], PipelineConfig(1, 1, mode="colocated")) as pipeline:
        times = time_pipeline(pipeline, prompt, TOKENS)
    assert len(times) == TOKENS + 1 and times[1:] == sorted(times[1:])


def test_a_stage_hop_and_nixls_round_trip_are_both_timed():
    hop = measure_hop(rounds=20)
    assert hop.link_rtt_us > 0 and hop.nixl_rtt_us > 0
    assert hop.ratio == pytest.approx(hop.link_rtt_us / hop.nixl_rtt_us)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_breakdown_against_a_real_cluster(tiny_model, tmp_path, mode):
    model = tiny_model("llama")
    assert main(["--breakdown", "--model", str(model), "--max-tokens", "16",
                 "--breakdown-requests", "2", "--breakdown-mode", mode,
                 "--out", str(tmp_path)]) == 0
    with (tmp_path / "breakdown.csv").open() as f:
        rows = {row["what"]: float(row["ms"]) for row in csv.DictReader(f)}
    # 1P+1T: a T-node alone cannot prefill, so the frontend layer holds the T-node's cost
    layers = ("engine", "pipeline", *(("T-node",) if mode == "colocated" else ()),
              "frontend", "ensemble")
    assert [what for what in rows if what in LAYERS] == list(layers)
    timed = (*layers, "link round trip", "nixl round trip", "decode step in process",
             "decode step in T-node")
    assert all(rows[name] > 0 for name in timed), rows
    rounds = [ms for what, ms in rows.items() if what.startswith("served / bare, round")]
    assert rounds and all(r > 0 for r in rounds), rows
    # the frontend's tritonserver and stub and the T-node's token service (its own process)
    # spent CPU on the tokens
    for process in ("frontend tritonserver", "frontend orchestrator (Python stub)",
                    "decode0 token service"):
        assert rows[f"CPU: {process}"] > 0, rows
