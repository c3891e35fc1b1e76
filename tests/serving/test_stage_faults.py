"""T-stages killed (kill -9) mid-stream on real tritonservers: the supervisor starts them
again and the pipeline resumes from the KV replicas (the client sees a pause, not an
error, and the failure-free tokens). Twice in a row; while the controller is away; over a
dropped connection. A stage lost together with the stage holding its replica, or the head's
stage, costs its requests a rerun from their prompts (still no error, the same tokens)."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import (
    FAULT_TOKENS,
    LONG,
    PROMPTS,
    SEEDED,
    Streaming,
    assert_all_freed,
    eventually,
    fault_cluster,
    held,
    ids_of,
    kill_mid_stream,
    metric,
    module_cluster,
    module_reference,
    reference,
)

from clients.generate import stream_grpc
from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import Cluster, read_state

pytestmark = pytest.mark.slow
def reruns(cluster: Cluster) -> float:
    """Requests the frontend ran again from their prompts so far."""
    return metric(cluster.frontend, "dejavu_reruns", what="request")


def repairs(cluster: Cluster, *outcomes: str) -> list[dict]:
    """The supervisor's repairs so far, as it records them in the cluster's state; only
    those with one of ``outcomes`` if named."""
    done = read_state(cluster.run_dir).get("repairs", [])
    return [r for r in done if not outcomes or r["outcome"] in outcomes]


def recoveries(cluster: Cluster) -> list[dict]:
    """T-stage recoveries: resumed from replicas, or recomputed from the prompts."""
    return repairs(cluster, "resumed", "recomputed")


expected = module_reference(PROMPTS[:4], FAULT_TOKENS, to_end=False)  # FIXED streams
depth2 = module_cluster("depth2", fault_cluster, decode=1, decode_depth=2)


def test_a_killed_stage_resumes_from_its_replicas_twice_in_a_row(depth2, expected):
    undisturbed = ids_of(stream_grpc(depth2.frontend.grpc_url, PROMPTS[4],
                                     max_tokens=FAULT_TOKENS, **SEEDED))
    for round_ in (1, 2):
        requests = kill_mid_stream(depth2, PROMPTS[:4], ["decode0s1"], seeded=PROMPTS[4])
        assert [r.error for r in requests] == [None] * 5
        assert [ids_of(r.chunks) for r in requests] == [*expected, undisturbed]
        node = next(n for n in read_state(depth2.run_dir)["nodes"] if n["name"] == "decode0s1")
        assert node["incarnation"] == round_
        assert [r["outcome"] for r in recoveries(depth2)] == ["resumed"] * round_
        assert recoveries(depth2)[-1]["requests_kept"] == 5
        # Resumed, not rerun: no request started over from its prompt.
        assert reruns(depth2) == 0
        assert_all_freed(depth2)


def test_a_stage_lost_while_the_controller_is_away_recovers_when_it_is_back(depth2, expected):
    """The controller and a stage killed together: the head pauses on its own (stage
    heartbeats); the supervisor starts the controller again, the live nodes register again
    and re-send their acks, the lost stage, never re-registering, is declared dead, and
    the pipeline resumes from the replicas."""
    before, rerun = len(recoveries(depth2)), reruns(depth2)
    controller = read_state(depth2.run_dir)["controller"]["pid"]
    requests = kill_mid_stream(depth2, PROMPTS[:4], ["controller", "decode0s1"])
    assert read_state(depth2.run_dir)["controller"]["pid"] != controller
    assert [r.error for r in requests] == [None] * 4
    assert [ids_of(r.chunks) for r in requests] == expected
    assert len(recoveries(depth2)) == before + 1
    assert recoveries(depth2)[-1]["outcome"] == "resumed"
    assert reruns(depth2) == rerun
    assert_all_freed(depth2)


def test_a_lost_head_stage_restarts_its_pipeline_and_the_requests_rerun(depth2, expected):
    """Stage 0 holds the head and the clients' streams; with no spare to take its role, its
    requests run again from their prompts once the supervisor has started the whole
    pipeline afresh (with a spare: test_spares.py)."""
    rerun, afresh = reruns(depth2), len(repairs(depth2, "started afresh"))
    requests = kill_mid_stream(depth2, PROMPTS[:4], ["decode0s0"])
    assert [r.error for r in requests] == [None] * 4
    assert [ids_of(r.chunks) for r in requests] == expected
    assert [r["pipeline"] for r in repairs(depth2, "started afresh")[afresh:]] == ["decode0"]
    eventually(lambda: reruns(depth2), lambda n: n >= rerun + 4)
    assert_all_freed(depth2)


def test_with_replicas_on_local_disk_a_killed_stage_reads_them_back(model, expected, tmp_path):
    """The SSD variant (``replicate="disk"``): each stage writes its KV deltas to its own
    disk; the stage started again reads them back, and the pipeline resumes there."""
    with fault_cluster(model, tmp_path, decode=1, decode_depth=2,
                       replicate="disk") as cluster:
        requests = kill_mid_stream(cluster, PROMPTS[:4], ["decode0s1"])
        assert [r.error for r in requests] == [None] * 4
        assert [ids_of(r.chunks) for r in requests] == expected
        assert [r["outcome"] for r in recoveries(cluster)] == ["resumed"]
        assert reruns(cluster) == 0
        assert_all_freed(cluster)
        assert not list((tmp_path / "replicas").rglob("*.kv"))


def test_a_stage_lost_with_its_replica_holder_reruns_its_requests(model, expected, tmp_path):
    with fault_cluster(model, tmp_path, decode=1, decode_depth=3) as cluster:
        requests = kill_mid_stream(cluster, PROMPTS[:4], ["decode0s1", "decode0s2"])
        assert [r.error for r in requests] == [None] * 4
        assert [ids_of(r.chunks) for r in requests] == expected
        assert [r["outcome"] for r in recoveries(cluster)] == ["recomputed"]
        assert recoveries(cluster)[-1]["stages"] == [1, 2]
        eventually(lambda: reruns(cluster), lambda n: n >= 1)
        assert_all_freed(cluster)


def test_a_dropped_connection_between_stages_is_made_again(depth2, expected):
    """Stage 0 loses its connection to stage 1 (both live on): it reports it cannot send,
    the head pauses, and with every stage alive the supervisor connects the stages again;
    the step lost on the way is redone."""
    rerun, repaired = reruns(depth2), len(repairs(depth2, "links repaired"))
    requests = [Streaming(depth2.frontend.grpc_url, p) for p in PROMPTS[:4]]
    for r in requests:
        r.start()
    deadline = time.monotonic() + 60
    while not all(len(ids_of(r.chunks)) >= 8 for r in requests):
        assert time.monotonic() < deadline, "no tokens before the drop"
        time.sleep(0.05)
    assert chaos.main(["drop", "decode0s0", "--dir", str(depth2.run_dir)]) == 0
    for r in requests:
        r.join(150)
        assert not r.is_alive()
    assert [r.error for r in requests] == [None] * 4
    assert [ids_of(r.chunks) for r in requests] == expected
    assert [r["requests_kept"] for r in repairs(depth2, "links repaired")[repaired:]] == [4]
    assert reruns(depth2) == rerun
    assert_all_freed(depth2)


def test_without_replicas_a_lost_pipelines_requests_rerun_on_another(model, tmp_path):
    """The restart-from-scratch baseline (``replicate="off"``): a killed stage breaks its
    pipeline; its requests run again from their prompts on the other pipeline, and the
    supervisor starts the broken pipeline afresh, which then serves again."""
    with fault_cluster(model, tmp_path, decode=2, decode_depth=2,
                       replicate="off") as cluster:
        killed = []

        def a_busy_pipeline() -> list[str]:
            # JSQ splits them two and two, unless one pipeline looked down to the frontend
            # as they came: kill stage 1 of one that holds requests (long ones, so that
            # they are still running once it is killed).
            busy = sorted(name for name, h in held(cluster, "s1").items() if h["kv"])
            killed.append(busy[0].removesuffix("s1"))
            return busy[:1]

        requests = kill_mid_stream(cluster, PROMPTS[:4], a_busy_pipeline, after_tokens=1,
                                   max_tokens=LONG)
        assert [r.error for r in requests] == [None] * 4
        want = reference(model, PROMPTS[:4], LONG, to_end=False)  # FIXED streams
        assert [ids_of(r.chunks) for r in requests] == want
        # the killed pipeline's requests ran again on the other one
        eventually(lambda: reruns(cluster), lambda n: n >= 1)
        deadline = time.monotonic() + 60
        while [r["pipeline"] for r in repairs(cluster, "started afresh")] != killed:
            assert time.monotonic() < deadline, repairs(cluster)
            time.sleep(0.5)
        assert {n["name"]: n.get("incarnation", 0) for n in read_state(tmp_path)["nodes"]
                if n["role"] == "decode"} == {f"decode{i}s{x}": int(f"decode{i}" in killed)
                                             for i in (0, 1) for x in (0, 1)}
