"""Warm spares on real tritonservers (``dejavu up --spares N``): a T-stage killed mid-stream
hands its role to the spare, which was loaded beforehand; the pipeline resumes from the KV
replicas (same tokens, no request run again) and the supervisor starts a new spare. A
killed stage 0 hands its role to the spare too: stage 0's KV comes back from its replica on
stage 1 and the frontend re-attaches every request to the new head (none runs again).
``dejavu bench recovery`` at its smallest: every case's output well-formed, token-exact."""

from __future__ import annotations

import csv
import json
import os
import time
from types import SimpleNamespace

import pytest
from cluster_helpers import (
    FAULT_TOKENS,
    PROMPTS,
    SEEDED,
    assert_all_freed,
    eventually,
    fault_cluster,
    ids_of,
    kill_mid_stream,
    longest_gap,
    metric,
    reference,
    stream_grpc,
)

from benchmarks import recovery as bench
from orchestrator.cluster.launcher import read_state, status_main
from orchestrator.cluster.tritonserver import alive, is_ready

pytestmark = pytest.mark.slow


def node(state: dict, name: str) -> dict:
    return next(n for n in state["nodes"] if n["name"] == name)


def failed_requests(entry: dict) -> float:
    """Requests a node ended with an error (a head that lost them: the frontend reruns)."""
    port = int(entry["metrics"].split(":")[1])
    return metric(SimpleNamespace(metrics_port=port), "dejavu_requests", outcome="failed")


def assert_status_serves(run_dir, capsys) -> None:
    """``dejavu status`` (JSON and text) exits 0; the spare, whenever it shows DOWN, is a
    warning in both."""
    capsys.readouterr()
    assert status_main(["--dir", str(run_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    down = not node(shown, "spare0")["ready"]
    assert [w.startswith("spare0 DOWN") for w in shown["warnings"]] == [True] * down
    assert status_main(["--dir", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    spare_down = any(line.startswith("spare0 ") and " DOWN " in line for line in lines)
    warned = any(line.startswith("warning: spare0 DOWN") for line in lines)
    assert warned == spare_down, lines


def test_a_killed_stage_moves_to_the_spare_and_a_new_spare_starts(model, tmp_path, capsys):
    expected = reference(model, PROMPTS[:4], FAULT_TOKENS, to_end=False)
    with fault_cluster(model, tmp_path, decode=1, decode_depth=2, spares=1) as cluster:
        assert status_main(["--dir", str(tmp_path)]) == 0
        assert "standby" in capsys.readouterr().out
        before = read_state(tmp_path)
        spare, lost = node(before, "spare0"), node(before, "decode0s1")
        requests = kill_mid_stream(cluster, PROMPTS[:4], ["decode0s1"])
        assert [r.error for r in requests] == [None] * 4
        assert [ids_of(r.chunks) for r in requests] == expected
        with capsys.disabled():  # shown with -s (the test reads the status output it captures)
            print(f"stage 1 killed, a spare: longest client pause {longest_gap(requests):.2f} s")
        after = read_state(tmp_path)
        stage = node(after, "decode0s1")
        # The spare's process serves stage 1 now: not a new process, not a model load.
        assert (stage["grpc"], stage["pid"]) == (spare["grpc"], spare["pid"])
        # Resumed from the replicas: the head ended no request with an error.
        assert failed_requests(node(after, "decode0s0")) == 0
        deadline = time.monotonic() + 120
        while True:  # a new spare where the lost node was, loaded and on standby
            fresh = node(read_state(tmp_path), "spare0")
            ready = bool(fresh.get("pid") and alive(fresh["pid"]) and is_ready(fresh["http"]))
            assert_status_serves(tmp_path, capsys)  # while it loads too: a warning at most
            if ready:
                break
            assert time.monotonic() < deadline, "no new spare"
            time.sleep(0.2)
        assert fresh["grpc"] == lost["grpc"] and fresh["pid"] != lost["pid"]
        assert_all_freed(cluster)
        capsys.readouterr()
        assert status_main(["--dir", str(tmp_path), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [n["role"] for n in shown["nodes"]].count("spare") == 1


def test_a_killed_head_stage_moves_to_the_spare(model, tmp_path, capsys):
    """Stage 0 (the head) killed mid-stream: the spare takes its role, the surviving stage
    is wired to it and the pipeline serves again without starting afresh; every request is
    re-attached to the new head with the tokens it had, none runs again from its prompt,
    and every stream ends token-exact (a seeded sampled one as undisturbed)."""
    expected = reference(model, PROMPTS[:4], FAULT_TOKENS, to_end=False)
    with fault_cluster(model, tmp_path, decode=1, decode_depth=2, spares=1) as cluster:
        undisturbed = ids_of(stream_grpc(cluster.frontend.grpc_url, PROMPTS[4],
                                         max_tokens=FAULT_TOKENS, **SEEDED))
        before = read_state(tmp_path)
        spare, survivor = node(before, "spare0"), node(before, "decode0s1")
        requests = kill_mid_stream(cluster, PROMPTS[:4], ["decode0s0"], seeded=PROMPTS[4])
        assert [r.error for r in requests] == [None] * 5
        assert [ids_of(r.chunks) for r in requests] == [*expected, undisturbed]
        with capsys.disabled():  # shown in the suite's output, as stage 1's
            print(f"stage 0 killed, a spare: longest client pause {longest_gap(requests):.2f} s"
                  f" (load average {os.getloadavg()[0]:.1f})")
        frontend = cluster.frontend
        eventually(lambda: metric(frontend, "dejavu_reattached"), lambda n: n == 5)
        assert metric(frontend, "dejavu_reruns") == 0  # neither a request nor a prompt
        deadline = time.monotonic() + 30  # the repair is recorded once its last call returned
        while not (after := read_state(tmp_path)).get("repairs"):
            assert time.monotonic() < deadline, "no repair recorded"
            time.sleep(0.1)
        assert [(r["outcome"], r["stages"]) for r in after["repairs"]] == [("resumed", [0])]
        head = node(after, "decode0s0")
        assert (head["grpc"], head["pid"]) == (spare["grpc"], spare["pid"])
        assert node(after, "decode0s1")["pid"] == survivor["pid"]  # not started afresh
        assert_all_freed(cluster)


def test_bench_recovery_at_its_smallest(model, tmp_path):
    """Every case runs, each cluster's in turn; the output says what each cost, token-exact.
    A killed node is declared dead from its process's end (the supervisor's pid watch),
    well within the heartbeat timeout (3 s here)."""
    out = tmp_path / "out"
    code = bench.main(["--model", str(model), "--quick", "--out", str(out)])
    with open(out / "recovery.csv") as f:
        rows = {row["case"]: row for row in csv.DictReader(f)}
    assert code == 0
    assert set(rows) == set(bench.CASES)
    for case, row in rows.items():
        assert row["token_exact"] == "True" and row["errors"] == "0", case
        assert float(row["failed_s"]) > 0 and float(row["undisturbed_s"]) > 0
        assert float(row["client_pause_s"]) > 0
        if case not in ("controller", "frontend", "frontend-of-two"):  # watched nodes
            assert 0 <= float(row["detect_s"]) < 1.0, (case, row["detect_s"])
            assert float(row["repair_s"]) >= 0
    assert float(rows["p-node"]["ttft_new_requests_s"]) > 0
    assert float(rows["p-node+spare"]["ttft_new_requests_s"]) > 0  # prefilled by the P spare
    assert float(rows["frontend-of-two"]["ttft_new_requests_s"]) > 0  # served by the other
    saved = json.loads((out / "recovery.json").read_text())
    assert [r["case"] for r in saved["rows"]] == bench.CASES
