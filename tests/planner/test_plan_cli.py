"""``dejavu plan`` on a live tiny model, ``dejavu simulate``, and the byte model."""

from __future__ import annotations

import csv
import json
import math

import pytest
from safetensors import safe_open

from orchestrator.cli import main
from orchestrator.engine.config import ModelConfig
from orchestrator.planner.perf_model import Profile, layer_param_count
from orchestrator.planner.workload import load_trace
from orchestrator.profiles.profile import load_profile


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layer_param_count_matches_the_checkpoint(tiny_model, arch):
    model_dir = tiny_model(arch)
    cfg = ModelConfig.from_dir(model_dir)
    marker = ".h.0." if arch == "gpt2" else ".layers.0."
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        layer0 = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()  # noqa: SIM118
                     if marker in f".{k}")
    assert layer0 > 0
    assert layer_param_count(cfg) == layer0


@pytest.mark.slow  # m is measured over NIXL to a spawned receiver (the default)
def test_plan_profiles_a_live_model_and_writes_a_spec(tiny_model, tmp_path, capsys):
    model_dir = tiny_model("gpt2")
    out = tmp_path / "spec.json"
    code = main(["plan", "--model", str(model_dir), "--machines", "4", "--memory-gb", "1",
                 "--prompt-len", "32", "--new-tokens", "8", "--batch", "2", "--reps", "3",
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "decision:" in printed and "measured" in printed
    spec = json.loads(out.read_text())
    assert spec["version"] == 1 and spec["model_dir"] == str(model_dir)
    assert spec["mode"] in ("colocated", "disaggregated")
    decode = spec["decode"]
    used = decode["pipelines"] * decode["depth"]
    if spec["mode"] == "disaggregated":
        used += spec["prefill"]["pipelines"] * spec["prefill"]["depth"]
    assert 1 <= used <= spec["machines"] == 4
    profile = Profile.from_dict(spec["planner"]["profile"])
    assert profile.source["Y"] == profile.source["t"] == "measured"
    assert profile.source["m"] == "measured (KV over nixl, 2 processes)"  # the default transport
    # On a 4-layer toy, a token step is mostly Python overhead and may cost as much as
    # the prompt: only sanity is asserted here, the numbers are printed.
    assert profile.Y > 0 and profile.t > 0 and profile.m >= 1
    print(f"tiny gpt2 measured: Y={profile.Y * 1e3:.3f} ms t={profile.t * 1e3:.3f} ms "
          f"m={profile.m:.3f}")
    assert ModelConfig.from_dir(model_dir).num_layers == profile.L


def test_plan_what_if_decisions(tiny_model, capsys):
    model_dir = str(tiny_model("gpt2"))
    # 500 kB machines hold 2 of the 4 layers: pipelines of depth >= 2 (D_p, D_t >= 2).
    common = ["plan", "--model", model_dir, "--machines", "8", "--new-tokens", "16",
              "--prompt-len", "16", "--batch", "1", "--memory-gb", "0.0005"]
    assert main([*common, "--Y", "1.0", "--t", "0.01", "--m", "1.05"]) == 0
    out = capsys.readouterr().out
    # Y/t = 100: the formulas' split is P6+T2, but the model has 4 layers, so no pipeline
    # is deeper than 4 and 4 colocated pipelines of depth 2 beat every split that fits.
    assert "inequality says disaggregate" in out.replace("\n", " ")
    assert "P6" not in out and "depth 8" not in out
    assert "decision: 4x colocated depth 2" in out
    assert main([*common, "--Y", "0.011", "--t", "0.01", "--m", "1.5"]) == 0
    assert "colocated" in capsys.readouterr().out.split("decision:")[1]


def test_plan_pins_each_node_to_its_machines_devices(tiny_model, tmp_path):
    out = tmp_path / "spec.json"
    common = ["plan", "--model", str(tiny_model("gpt2")), "--machines", "6", "--new-tokens",
              "16", "--prompt-len", "16", "--batch", "1", "--memory-gb", "0.0005",
              "--Y", "1.0", "--t", "0.01", "--m", "1.05", "--out", str(out)]
    gpus = [f"cuda:{i}" for i in range(6)]
    assert main([*common, "--devices", *gpus]) == 0
    # P4+T2 (the formulas' P5+T1 capped: D_t >= 2, and 4 layers): the P-node's 4 stages
    # share one process.
    spec = json.loads(out.read_text())
    assert spec["devices"] == {"prefill0": "cuda:0,1,2,3", "decode0s0": "cuda:4",
                               "decode0s1": "cuda:5"}
    with pytest.raises(SystemExit) as e:
        main([*common, "--devices", *gpus[:3]])
    assert e.value.code == 2


def test_plan_rejects_bad_input(tiny_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tiny_model("gpt2")), "--Y", "1.0"])
    assert e.value.code == 2 and "--Y, --t and --m" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "/nonexistent", "--Y", "1", "--t", "0.1", "--m", "1"])
    assert e.value.code == 2 and "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tiny_model("gpt2")), "--prompt-len", "0",
              "--Y", "1", "--t", "0.1", "--m", "1"])
    assert e.value.code == 2 and "prompt_len" in capsys.readouterr().err


def test_simulate_writes_table_csv_and_png(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--trace", "conv", "--machines", "2-5", "--requests", "24",
                 "--seed", "1", "--out", str(out)]) == 0
    assert "best layout per policy" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "simulate.csv").open()))
    assert {r["policy"] for r in rows} == {"colocated", "colocated-dp", "disaggregated"}
    assert {int(r["machines"]) for r in rows} == {2, 3, 4, 5}
    assert all(float(r["makespan_s"]) > 0 for r in rows)
    png = (out / "makespan.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    timed = tmp_path / "timed"
    assert main(["simulate", "--trace", "conv", "--machines", "2", "--requests", "8",
                 "--engine-profile", "splitwise-llama2-70b-h100", "--out", str(timed)]) == 0
    timed_rows = list(csv.DictReader((timed / "simulate.csv").open()))
    assert {r["makespan_s"] for r in timed_rows}.isdisjoint(
        r["makespan_s"] for r in rows if r["machines"] == "2")


def test_shipped_traces_load():
    """The traces ship inside the package: nothing beside the repository is needed."""
    conv, code = load_trace("conv"), load_trace("code")
    assert len(conv) == 19366 and len(code) == 8819
    assert conv[0].arrival == 0.0 and all(r.prompt_len > 0 for r in code)


def test_plan_reads_the_engine_profile_the_emulated_engine_sleeps(tiny_model, tmp_path):
    out = tmp_path / "spec.json"
    name = "splitwise-llama2-70b-h100"
    assert main(["plan", "--model", str(tiny_model("llama")), "--machines", "8",
                 "--prompt-len", "1024", "--new-tokens", "128", "--batch", "4",
                 "--engine-profile", name, "--m", "1.04", "--out", str(out)]) == 0
    profile = Profile.from_dict(json.loads(out.read_text())["planner"]["profile"])
    cost = load_profile(name)
    assert cost.prefill_s(4 * 1024) == pytest.approx(profile.Y)
    assert profile.t == pytest.approx(cost.decode_s(4, 1024 + 64))
    assert profile.m == 1.04 and profile.source["Y"] == f"engine profile {name}"
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tiny_model("llama")), "--engine-profile", name,
              "--Y", "1"])
    assert e.value.code == 2


def test_plan_on_a_trace_scores_layouts_by_the_capacity_model(tiny_model, tmp_path, capsys):
    """``--trace`` with an engine profile: every layout scored by the capacity model on the
    trace's lengths (what the bench measures), the best one written to the spec."""
    from orchestrator.planner import workload as wl
    from orchestrator.planner.capacity import Capacity
    from orchestrator.planner.planner import layouts, predict_rps

    out, name = tmp_path / "spec.json", "splitwise-llama2-70b-h100"
    assert main(["plan", "--model", str(tiny_model("llama")), "--machines", "8",
                 "--batch", "16", "--engine-profile", name, "--trace", "code",
                 "--requests", "300", "--out", str(out)]) == 0
    assert "scored by capacity" in capsys.readouterr().out
    numbers = json.loads(out.read_text())["planner"]
    assert numbers["model"] == "capacity"
    lengths = [(r.prompt_len, r.output_len) for r in wl.sample(wl.load_trace("code"), 300, 0)]
    capacity = Capacity.of(lengths, load_profile(name), 16)
    by_name = {str(lay): lay for lay in layouts(8, 1, 1)}
    for candidate in numbers["candidates"]:
        assert candidate["rps"] == pytest.approx(
            predict_rps(capacity, by_name[candidate["layout"]]))
    assert numbers["chosen"] == max(numbers["candidates"], key=lambda c: c["rps"])["layout"]
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tiny_model("llama")), "--trace", "code"])
    assert e.value.code == 2
