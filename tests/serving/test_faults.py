"""Faults on real tritonservers: the controller watches every node, a P-node killed with
kill -9 costs its prompts a pause (they re-run on the other P-node, token-exact) and is
started again by the supervisor, and serving goes on while the controller itself is gone.
Every process comes back: the frontend and the controller (the supervisor starts them),
the supervisor (its watchdog does), each followed by requests answered once, token-exact."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cluster_helpers import (
    PROMPTS,
    complete,
    eventually,
    ids_concurrently,
    ids_of,
    metric,
    module_cluster,
    module_reference,
)

from clients.generate import stream_grpc
from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import OPENAI_STANDBY, read_state, status_main
from orchestrator.cluster.tritonserver import alive, is_ready
from orchestrator.cluster.watchdog import read_pid

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
CONTROLLER_TIMEOUT_S = 3.0


cluster = module_cluster("faults", prefill=2, decode=1, controller_timeout_s=CONTROLLER_TIMEOUT_S)
expected = module_reference(PROMPTS * 2, MAX_TOKENS)


def status(cluster, capsys) -> tuple[int, dict]:
    code = status_main(["--json", "--dir", str(cluster.run_dir)])
    return code, json.loads(capsys.readouterr().out)


def wait_for_view(cluster, capsys, want: dict[str, str], timeout_s: float) -> dict:
    """Poll ``dejavu status --json`` until the controller's view of each named node is
    ``want[name]``; the last state seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, state = status(cluster, capsys)
        seen = {n["name"]: n["controller"] for n in state["nodes"]}
        if all(seen[name] == view for name, view in want.items()) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def chaos_kill(cluster, name: str, capsys) -> None:
    assert chaos.main(["kill", name, "--dir", str(cluster.run_dir)]) == 0
    assert f"killed {name}" in capsys.readouterr().out


def test_every_node_registers_and_status_shows_the_controller_view(cluster, capsys):
    workers = {n.server.name: "alive" for n in cluster.nodes if n.role != "frontend"}
    state = wait_for_view(cluster, capsys, workers, timeout_s=30)
    assert {n["name"]: n["controller"] for n in state["nodes"]} == {**workers, "frontend": "-"}
    assert state["controller"]["view"]["timeout_s"] == CONTROLLER_TIMEOUT_S
    assert status(cluster, capsys)[0] == 0
    assert chaos.main(["list", "--dir", str(cluster.run_dir)]) == 0
    listed = capsys.readouterr().out
    assert all(f"{name} " in listed for name in [*workers, "frontend", "controller"])


def test_a_killed_prefill_node_costs_a_pause_not_an_error(cluster, expected, capsys):
    prompts = PROMPTS * 2
    dead = cluster.role("prefill")[0].server
    # Killed just before a burst: prompts that meet it run again on the other P-node, and
    # once the failure is seen the router sends it none (which comes first is a race the
    # product may win: only the outcome is asserted).
    chaos_kill(cluster, dead.name, capsys)
    assert ids_concurrently("grpc", cluster.frontend.grpc_url, prompts, MAX_TOKENS) == expected

    state = wait_for_view(cluster, capsys, {dead.name: "dead"}, CONTROLLER_TIMEOUT_S + 10)
    assert {n["name"]: n["controller"] for n in state["nodes"]}[dead.name] == "dead"
    # The supervisor starts it again (a new incarnation on the same ports): it serves.
    state = wait_for_view(cluster, capsys, {dead.name: "alive"}, 60)
    assert {n["name"]: n["controller"] for n in state["nodes"]}[dead.name] == "alive"
    deadline = time.monotonic() + 30  # the supervisor records it once it is ready
    while {n["name"]: n.get("incarnation") for n in read_state(cluster.run_dir)["nodes"]}[
            dead.name] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Every node ready and alive to the controller (a busy machine may take a moment).
    deadline = time.monotonic() + 30
    while (now := status(cluster, capsys))[0] != 0:
        assert time.monotonic() < deadline, now[1]
        time.sleep(0.2)
    # Once the router's memory of the failure (5 s) is over, JSQ sends the restarted node
    # prompts again. (The frontend's channel to it may still wait out its reconnect backoff,
    # up to 1 s, as the node comes back: a prompt sent then runs again elsewhere.)
    deadline = time.monotonic() + 30
    while metric(dead, "dejavu_requests", outcome="finished") == 0:
        assert time.monotonic() < deadline, "the restarted P-node got no prompt"
        assert ids_concurrently("grpc", cluster.frontend.grpc_url, prompts[:4],
                                MAX_TOKENS) == expected[:4]
    # Serving again, it takes its prompts at the first try: no prompt runs twice.
    retried, finished = reruns(cluster), metric(dead, "dejavu_requests", outcome="finished")
    assert ids_concurrently("grpc", cluster.frontend.grpc_url, prompts, MAX_TOKENS) == expected
    eventually(lambda: metric(dead, "dejavu_requests", outcome="finished"),
               lambda n: n > finished)
    assert metric(dead, "dejavu_requests", outcome="failed") == 0
    assert reruns(cluster) == retried


def reruns(cluster) -> float:
    """Prompts the frontend ran again on another P-node."""
    return metric(cluster.frontend, "dejavu_reruns", what="prompt")


def wait_for(what: str, ok, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.2)


def serves_every_request_once(cluster, expected) -> None:
    url = cluster.frontend.grpc_url
    assert ids_concurrently("grpc", url, PROMPTS * 2, MAX_TOKENS) == expected


def test_serving_goes_on_without_the_controller_and_it_comes_back(cluster, expected, capsys):
    before = read_state(cluster.run_dir)["controller"]["pid"]
    chaos_kill(cluster, "controller", capsys)
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[1], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected[1]
    # The supervisor starts it again on its port; every node registers again.
    wait_for("a new controller", lambda: read_state(cluster.run_dir)["controller"]["pid"]
             not in (None, before), 60)
    wait_for("every node alive in its view", lambda: status(cluster, capsys)[0] == 0, 60)
    serves_every_request_once(cluster, expected)


def test_a_killed_frontend_is_started_again(cluster, expected, capsys):
    def frontend_pid() -> int:
        return next(n["pid"] for n in read_state(cluster.run_dir)["nodes"]
                    if n["role"] == "frontend")

    before = frontend_pid()
    serves_every_request_once(cluster, expected)
    chaos_kill(cluster, "frontend", capsys)
    wait_for("a new frontend", lambda: frontend_pid() != before and alive(frontend_pid()), 60)
    wait_for("the frontend ready", lambda: is_ready(cluster.frontend.http_url), 120)
    serves_every_request_once(cluster, expected)


def standby_waiting(cluster) -> bool:
    """The OpenAI API's warm spare is loaded: it holds the FIFO it waits on open."""
    pid = read_state(cluster.run_dir)["openai"].get("standby_pid")
    fifo = str(cluster.run_dir / OPENAI_STANDBY)
    try:
        return pid is not None and any(os.readlink(fd) == fifo
                                       for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone meanwhile
        return False


def test_a_killed_openai_api_serves_again_within_5_s(cluster, capsys):
    assert chaos.main(["list", "--dir", str(cluster.run_dir)]) == 0
    assert "openai " in capsys.readouterr().out
    before = read_state(cluster.run_dir)["openai"]["pid"]
    text = complete(cluster, PROMPTS[2], MAX_TOKENS)
    wait_for("the OpenAI API's standby loaded", lambda: standby_waiting(cluster), 60)
    chaos_kill(cluster, "openai", capsys)
    killed = time.monotonic()
    while True:  # the supervisor starts it again on its port
        try:
            again = complete(cluster, PROMPTS[2], MAX_TOKENS)
            break
        except OSError:  # refused, reset: not back yet
            assert time.monotonic() - killed < 5.0, "the OpenAI API not back within 5 s"
            time.sleep(0.05)
    assert again == text
    assert read_state(cluster.run_dir)["openai"]["pid"] not in (None, before)


def test_a_killed_supervisor_is_started_again_and_still_recovers_nodes(cluster, expected,
                                                                       capsys):
    before = read_pid(cluster.run_dir, "supervisor")
    chaos_kill(cluster, "supervisor", capsys)
    wait_for("a new supervisor", lambda: read_pid(cluster.run_dir, "supervisor") != before
             and alive(read_pid(cluster.run_dir, "supervisor")), 30)
    # The new one does the old one's work: a lost P-node comes back.
    dead = cluster.role("prefill")[1].server.name
    chaos_kill(cluster, dead, capsys)
    wait_for_view(cluster, capsys, {dead: "dead"}, CONTROLLER_TIMEOUT_S + 10)
    wait_for("every node back", lambda: status(cluster, capsys)[0] == 0, 120)
    serves_every_request_once(cluster, expected)
    # A killed watchdog is started again by the supervisor.
    watchdog = read_pid(cluster.run_dir, "watchdog")
    chaos_kill(cluster, "watchdog", capsys)
    wait_for("a new watchdog", lambda: read_pid(cluster.run_dir, "watchdog") != watchdog
             and alive(read_pid(cluster.run_dir, "watchdog")), 30)


def test_a_p_node_whose_tritonserver_alone_aborts_is_started_again(cluster, expected, capsys):
    # Triton's python backend can abort the server and leave its stub running (seen under
    # load: boost::interprocess::lock_exception); the stub's beats stop with its server.
    node = next(n for n in read_state(cluster.run_dir)["nodes"] if n["name"] == "prefill0")
    os.kill(node["pid"], signal.SIGABRT)  # the server process only, not its group
    wait_for_view(cluster, capsys, {"prefill0": "dead"}, CONTROLLER_TIMEOUT_S + 10)
    assert {n["name"]: n["controller"] for n in status(cluster, capsys)[1]["nodes"]}[
        "prefill0"] == "dead"
    wait_for("every node back", lambda: status(cluster, capsys)[0] == 0, 120)
    serves_every_request_once(cluster, expected)
