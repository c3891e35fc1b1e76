"""The coordinator's side of a lost stage 0's recovery, its nodes played by the test (a
call log): each request keeps what every survivor and stage 1's replica of stage 0 hold,
that KV is restored into the new stage 0, and the new head learns what it may take back
before it resumes. (Served end to end: tests/serving/test_spares.py.)"""

from __future__ import annotations

import json

from orchestrator.fault.stage_recovery import recover_stage

HEAD, STAGE1 = "new-stage-0", "stage-1"


def test_a_lost_head_keeps_what_both_stages_hold_and_the_new_head_learns_it():
    calls: list[tuple[str, str, list[bytes]]] = []
    held = {"kv": {"5": ["a", 9], "6": ["b", 7], "7": ["c", 4]},  # c: its replica not seeded
            "replicas": {"5": 8, "6": 7}}

    def call(url: str, op: str, args: list[bytes]) -> bytes:
        calls.append((url, op, args))
        answers = {"quiet": b"1", "sequences": json.dumps(held).encode(),
                   "rewind": json.dumps({"lengths": {}, "sampling": {}}).encode()}
        return answers.get(op, f"{op}-of-{url}".encode())

    plan = {"failed": [0], "recompute": False, "resume": {}, "restore": [[1, 0]], "epoch": 3}
    kept = recover_stage(call, [HEAD, STAGE1], plan)

    assert kept == {"5": 8, "6": 7}
    ops = [(url, op) for url, op, _ in calls]
    args = {(url, op): a for url, op, a in calls}
    assert json.loads(args[STAGE1, "restore"][1]) == kept  # stage 0's KV, from its replica
    assert json.loads(args[HEAD, "adopt"][0]) == kept
    assert json.loads(args[STAGE1, "rollback"][0]) == kept  # c's KV is dropped
    assert json.loads(args[HEAD, "reattachable"][0]) == {"a": [5, 8], "b": [6, 7]}
    assert ops.index((HEAD, "adopt")) < ops.index((HEAD, "reattachable")) < ops.index(
        (STAGE1, "rollback")) < ops.index((HEAD, "resume"))
    assert (STAGE1, "follow_head") in ops


def test_a_recomputing_recovery_keeps_nothing_of_a_lost_head():
    calls: list[tuple[str, str]] = []

    def call(url: str, op: str, args: list[bytes]) -> bytes:
        calls.append((url, op))
        if op == "sequences":
            return json.dumps({"kv": {"5": ["a", 9]}, "replicas": {"5": 9}}).encode()
        if op == "rewind":
            return json.dumps({"lengths": {}, "sampling": {}}).encode()
        return b"1"

    plan = {"failed": [0], "recompute": True, "resume": {}, "restore": [], "epoch": 1}
    assert recover_stage(call, [HEAD, STAGE1], plan) == {}
    assert (HEAD, "reattachable") not in calls and (STAGE1, "restore") not in calls
