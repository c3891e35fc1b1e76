"""The supervisor's choice when a stage's recovery fails (its actuators faked: the real
path runs in tests/serving/test_spares.py and test_stage_faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cluster import supervisor as supervisor_module
from orchestrator.cluster.supervisor import Supervisor

PLAN = {"failed": [1], "recompute": False, "resume": {}, "restore": [], "epoch": 3}
STATE = {"nodes": [{"role": "decode", "pipeline": 0, "stage": i, "grpc": f"127.0.0.1:{9000 + i}",
                    "name": f"decode0s{i}"} for i in range(3)]}


class Actuators(Supervisor):
    """A supervisor whose process starts are recorded, not made."""

    def __init__(self, restart_fails: bool = False) -> None:  # no run dir, no secret
        self.run_dir, self.given_up = Path("/nonexistent"), set()
        self.restarted: list[list[str]] = []
        self.recorded: list[str] = []
        self.restart_fails = restart_fails

    def replace(self, state: dict, name: str, index: int) -> dict:
        return PLAN

    def restart_nodes(self, state: dict, name: str, nodes: list[dict]) -> None:
        self.restarted.append([n["name"] for n in nodes])
        if self.restart_fails:
            raise TimeoutError("the controller did not take the new nodes")

    def record(self, state: dict, pipeline: str, outcome: str, **details) -> None:
        self.recorded.append(outcome)


@pytest.fixture
def failing_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    def recover_stage(*args, **kwargs):
        raise TimeoutError("stage 2 still busy 30 s after the pause")

    monkeypatch.setattr(supervisor_module, "recover_stage", recover_stage)


def test_a_failed_recovery_starts_the_whole_pipeline_afresh(failing_recovery) -> None:
    # Its head would otherwise hold the requests for its recover timeout (120 s): longer
    # than a client waits for a token.
    supervisor = Actuators()
    supervisor.recover(STATE, "decode0")
    assert supervisor.restarted == [["decode0s0", "decode0s1", "decode0s2"]]
    assert supervisor.recorded == []  # restart_nodes records its own outcome
    assert supervisor.given_up == set()


def test_a_pipeline_that_cannot_start_afresh_either_is_given_up(failing_recovery) -> None:
    supervisor = Actuators(restart_fails=True)
    supervisor.recover(STATE, "decode0")
    assert supervisor.restarted == [["decode0s0", "decode0s1", "decode0s2"]]
    assert supervisor.given_up == {"decode0"}
