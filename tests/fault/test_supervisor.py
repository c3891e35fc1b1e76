"""The supervisor's choice when a stage's recovery fails, and a lost P-node's role moved to
a warm P spare (its actuators faked: the real paths run in tests/serving/test_spares.py,
test_stage_faults.py and test_prefill_faults.py)."""

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


class Control:
    """The spares' control calls, recorded; ``refuse``: the spares that fail them."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str, list[bytes], str]] = []
        self.refuse = refuse

    def call(self, url: str, op: str, args: list[bytes], model: str = "decode") -> bytes:
        self.calls.append((url, op, args, model))
        if url in self.refuse:
            raise RuntimeError("refused")
        return b""


def p_node(name: str, role: str, port: int, pid: int | None) -> dict:
    pipeline = 0 if role == "prefill" else None
    return {"name": name, "role": role, "pipeline": pipeline, "stage": None, "pid": pid,
            "grpc": f"127.0.0.1:{port}", "log": f"/logs/{name}.log",
            "config": {"name": f"{name}-{port}", "role": role, "pipeline": 0, "stage": 0}}


def test_a_lost_p_node_s_role_moves_to_a_warm_p_spare(monkeypatch) -> None:
    killed: list[str] = []
    monkeypatch.setattr(supervisor_module, "kill", lambda node, sig: killed.append(node["name"]))
    supervisor = Actuators()
    supervisor.control, supervisor.spare_delay_s = Control(refuse=("127.0.0.1:9102",)), 10.0
    closed: list[list[str]] = []
    supervisor.close_repair = lambda state, name, nodes: closed.append(
        [n["config"]["name"] for n in nodes])
    supervisor.write_state = lambda state: None
    state = {"nodes": [p_node("prefill0", "prefill", 9100, 1), p_node("spare0", "spare", 9101, 2),
                       p_node("pspare0", "prefill_spare", 9102, 3),
                       p_node("pspare1", "prefill_spare", 9103, 4)]}
    supervisor.recover(state, "prefill0")
    # A T spare is not asked; the P spare that refuses is stopped, the next one takes it.
    assert [(url, op, args, model) for url, op, args, model in supervisor.control.calls] == [
        ("127.0.0.1:9102", "assume", [b"0"], "prefill"),
        ("127.0.0.1:9103", "assume", [b"0"], "prefill")]
    assert killed == ["pspare0", "prefill0"]
    nodes = {n["name"]: n for n in state["nodes"]}
    assert (nodes["prefill0"]["grpc"], nodes["prefill0"]["pid"]) == ("127.0.0.1:9103", 4)
    assert nodes["prefill0"]["config"] == {"name": "pspare1-9103", "role": "prefill",
                                           "pipeline": 0, "stage": 0}
    assert (nodes["pspare1"]["grpc"], nodes["pspare1"]["pid"]) == ("127.0.0.1:9100", None)
    assert nodes["pspare1"]["role"] == nodes["pspare1"]["config"]["role"] == "prefill_spare"
    assert nodes["pspare0"]["pid"] is None  # started again by replenish
    assert closed == [["pspare1-9103"]]  # the controller hears the spare closed the repair
    assert supervisor.recorded == ["taken over"]
    assert supervisor.restarted == []
