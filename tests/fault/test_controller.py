"""The controller as a real process: registration, heartbeats, detection, acks, loss and return."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from controller_helpers import unsent_acks, wait_for_plan
from replicated_pipeline import SECRET

from orchestrator.control.auth import ENV
from orchestrator.fault.client import ControllerClient, NodeSpec, query_status
from orchestrator.fault.controller import ControllerState
from orchestrator.fault.rpc import RequestError, Stub

NODE_PROC = Path(__file__).with_name("node_proc.py")


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Poll ``ok`` until true; returns the seconds it took."""
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def clients(address: str, pipeline: str, depth: int, heartbeat_s: float = 0.05):
    return [
        ControllerClient(address, NodeSpec(pipeline, s, depth), SECRET, heartbeat_s).start()
        for s in range(depth)
    ]


def node(status: dict, node_id: str) -> dict:
    return next(n for n in status["nodes"] if n["node_id"] == node_id)


def test_registration_heartbeats_and_status(controller: str) -> None:
    nodes = clients(controller, "reg", 2)
    try:
        wait_until("registration", lambda: all(c.connected for c in nodes))
        time.sleep(0.3)  # several beats
        status = query_status(controller, SECRET)
        assert status["pipelines"]["reg"]["state"] == "serving"
        for c in nodes:
            seen = node(status, c.node_id)
            assert seen["alive"] and seen["stage"] == c.spec.stage
            assert seen["last_seen_s"] < 0.5  # beating, not just registered
    finally:
        for c in nodes:
            c.stop()


def test_bad_registrations_are_rejected_by_name(controller: str) -> None:
    stub = Stub(controller, SECRET)
    base = {"node_id": "n1", "pipeline": "bad", "stage": 3, "depth": 2}
    with pytest.raises(grpc.RpcError, match="stage 3 outside a pipeline of depth 2") as info:
        stub.call("Register", base, 2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError, match="unknown role 'gpu'"):
        stub.call("Register", {**base, "stage": 0, "role": "gpu"}, 2.0)
    stub.call("Register", {**base, "stage": 0}, 2.0)
    with pytest.raises(grpc.RpcError, match="held by live node 'n1'") as info:
        stub.call("Register", {**base, "node_id": "n2", "stage": 0}, 2.0)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError, match="unknown node 'ghost'") as info:
        stub.call("Heartbeat", {"node_id": "ghost"}, 2.0)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError, match="bad request"):
        stub.call("Ack", {"node_id": "n1"}, 2.0)
    stub.close()


def test_calls_without_the_cluster_secret_are_refused(controller: str) -> None:
    """A fake Register (or any call) without the secret changes nothing: the real node
    stays alive in the controller's view."""
    real = ControllerClient(controller, NodeSpec("auth", 0, 1), SECRET, 0.05).start()
    forger = Stub(controller, b"not-the-cluster-secret")
    try:
        wait_until("registration", lambda: real.connected)
        fake = {"node_id": "fake", "pipeline": "auth", "stage": 0, "depth": 1,
                "address": "127.0.0.1:1"}
        beat = {"node_id": real.node_id, "seq": 10**6}
        for method, request in [("Register", fake), ("Heartbeat", beat),
                                ("Ack", {"node_id": real.node_id, "acks": [[0, 0, 99]]}),
                                ("Recovered", {"node_id": real.node_id, "epoch": 0}),
                                ("Plan", {"pipeline": "auth"}), ("Status", {})]:
            with pytest.raises(grpc.RpcError, match="bad request signature") as info:
                forger.call(method, request, 2.0)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel = grpc.insecure_channel(controller)  # no signature at all
        with pytest.raises(grpc.RpcError, match="unsigned request") as info:
            channel.unary_unary("/dejavu.Controller/Register")(json.dumps(fake).encode(),
                                                               timeout=2.0)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        status = query_status(controller, SECRET)
        assert [n["node_id"] for n in status["nodes"] if n["pipeline"] == "auth"] == [
            real.node_id]
        assert node(status, real.node_id)["alive"]
        assert [0, 0, 99] not in status["pipelines"]["auth"]["acks"]
    finally:
        forger.close()
        real.stop()


def test_kill_9_node_is_detected_within_the_timeout(controller_factory) -> None:
    timeout_s = 1.0
    _, address = controller_factory(timeout_s)
    proc = subprocess.Popen(
        [sys.executable, str(NODE_PROC), address, "k9", "0", "1", "0.05"],
        stdout=subprocess.PIPE, text=True, env=os.environ | {ENV: SECRET.hex()},
    )
    try:
        node_id = proc.stdout.readline().strip()
        assert node_id.startswith("k9/0/")
        assert node(query_status(address, SECRET), node_id)["alive"]
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=10)
        wait_until("detection", lambda: not node(query_status(address, SECRET), node_id)["alive"])
        detected_s = time.monotonic() - killed
        # Declared dead after the timeout (less at most one beat), well before twice it.
        assert timeout_s - 0.06 <= detected_s <= timeout_s + 1.0, detected_s
        pipeline = query_status(address, SECRET)["pipelines"]["k9"]
        assert pipeline["state"] == "paused" and pipeline["failed"] == [0]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_node_whose_server_died_is_declared_dead_though_it_runs_on(controller_factory
                                                                     ) -> None:
    """A Python-backend stub can outlive its tritonserver (seen after a SIGABRT): its
    heartbeats stop with its parent, so the controller declares the node dead and the
    supervisor starts it again, rather than the stub keeping a dead node alive. The stub
    says so as it stops beating: dead at once, not after the (here 30 s) timeout."""
    _, address = controller_factory(30.0)
    server = subprocess.Popen(  # stands for tritonserver: the node runs as its child
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
         sys.executable, str(NODE_PROC), address, "orphan", "0", "1", "0.05"],
        stdout=subprocess.PIPE, text=True, env=os.environ | {ENV: SECRET.hex()},
        start_new_session=True,
    )
    try:
        node_id = server.stdout.readline().strip()
        assert node(query_status(address, SECRET), node_id)["alive"]
        os.kill(server.pid, signal.SIGKILL)  # the server only: the node process runs on
        server.wait(timeout=10)
        wait_until("detection", lambda: not node(query_status(address, SECRET), node_id)["alive"],
                   timeout_s=5.0)
        os.killpg(server.pid, 0)  # the node's process is still there
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def test_acks_pick_the_step_to_redo_and_a_replacement_gets_the_plan(controller: str) -> None:
    nodes = clients(controller, "acks", 3)
    try:
        wait_until("registration", lambda: all(c.connected for c in nodes))
        # Holder (x+1)%3 acks stage x; stage 1 is lost. Microbatch 0: its replica holds
        # step 6 -> redo step 7. Microbatch 1: step 3 -> redo step 4. (The head goes back
        # further if it has no answer for those steps.)
        for holder, source, j, t in [(1, 0, 0, 7), (2, 1, 0, 5), (2, 1, 0, 6), (0, 2, 0, 7),
                                     (1, 0, 1, 3), (2, 1, 1, 3)]:
            nodes[holder].ack(source, j, t)
        wait_until("acks sent", lambda: not any(unsent_acks(c) for c in nodes))
        nodes[1].stop()  # the crash of stage 1
        spare = ControllerClient(controller, NodeSpec("acks", 1, 3), SECRET, 0.05).start()
        plan = wait_for_plan(controller, SECRET, "acks", after_epoch=0, timeout_s=10)
        assert plan["failed"] == [1] and not plan["recompute"]
        assert plan["restore"] == [[2, 1]] and plan["rereplicate"] == [[0, 1]]
        assert plan["resume"] == {"0": 7, "1": 4} and plan["first"] == [1, 4]
        live = [n["node_id"] for n in query_status(controller, SECRET)["nodes"]
                if (n["pipeline"], n["stage"], n["alive"]) == ("acks", 1, True)]
        assert live == [spare.node_id]  # the replacement holds the lost stage
        for c in (nodes[0], spare, nodes[2]):
            again = wait_for_plan(controller, SECRET, "acks", 0, timeout_s=5)
            assert again["epoch"] == plan["epoch"]
            c.recovered(plan["epoch"])
        assert query_status(controller, SECRET)["pipelines"]["acks"]["state"] == "serving"
        # Everyone rolled back to step 6 of microbatch 0, step 3 of microbatch 1.
        acks = query_status(controller, SECRET)["pipelines"]["acks"]["acks"]
        assert sorted(acks) == [[0, 0, 6], [0, 1, 3], [1, 0, 6], [1, 1, 3], [2, 0, 6],
                                [2, 1, 3]]
    finally:
        for c in nodes:
            c.stop()
        spare.stop()


def test_an_ack_goes_out_at_once_not_with_the_next_beat(controller: str) -> None:
    """The heartbeat thread sleeps until a beat is due or an ack is made: an ack reaches
    the controller within its ack interval even when the next beat is minutes away."""
    (holder,) = clients(controller, "prompt-acks", 1, heartbeat_s=300.0)
    try:
        wait_until("registration", lambda: holder.connected)
        holder.ack(0, 0, 5)
        # The outcome, at the controller: the client's set empties before its Ack call lands.
        wait_until("the ack at the controller", lambda: query_status(controller, SECRET)[
            "pipelines"]["prompt-acks"]["acks"] == [[0, 0, 5]], timeout_s=5.0)
    finally:
        holder.stop()


def test_neighbour_dead_too_means_recompute(controller: str) -> None:
    nodes = clients(controller, "both", 3)
    try:
        wait_until("registration", lambda: all(c.connected for c in nodes))
        for holder, source in [(1, 0), (2, 1), (0, 2)]:
            nodes[holder].ack(source, 0, 4)
        time.sleep(0.1)
        nodes[1].stop()
        nodes[2].stop()  # the holder of stage 1's replica
        spares = [ControllerClient(controller, NodeSpec("both", s, 3), SECRET, 0.05).start()
                  for s in (1, 2)]
        plan = wait_for_plan(controller, SECRET, "both", 0, timeout_s=10)
        while plan["failed"] != [1, 2]:  # both deaths may land in different sweeps
            plan = wait_for_plan(controller, SECRET, "both", plan["epoch"], timeout_s=10)
        assert plan["recompute"] and plan["restore"] == [] and plan["resume"] == {"0": 0}
    finally:
        for c in nodes + spares:
            c.stop()


def test_controller_loss_and_return(controller_factory) -> None:
    timeout_s = 1.0
    proc, address = controller_factory(timeout_s)
    port = int(address.rsplit(":", 1)[1])
    nodes = clients(address, "gone", 3)
    stub = Stub(address, SECRET)  # kept across the restart, as a polling caller keeps it
    try:
        wait_until("registration", lambda: all(c.connected for c in nodes))
        nodes[1].ack(0, 0, 3)
        time.sleep(0.1)
        proc.kill()
        proc.wait(timeout=10)
        wait_until("nodes noticing", lambda: not any(c.connected for c in nodes))
        # Serving goes on: acks are recorded without blocking while it is away.
        start = time.monotonic()
        for t in range(4, 40):
            nodes[1].ack(0, 0, t)
        assert time.monotonic() - start < 0.05
        nodes[2].stop()  # dies while nobody watches: undetected until the controller returns
        time.sleep(2 * timeout_s)
        _, again = controller_factory(timeout_s, port)
        assert again == address
        wait_until("re-registration", lambda: nodes[0].connected and nodes[1].connected)
        assert query_status(stub)["pipelines"]["gone"]["state"] == "serving"  # not yet
        detected = wait_until(
            "detection of the stage that died meanwhile",
            lambda: query_status(stub)["pipelines"]["gone"]["failed"] == [2],
        )
        assert detected <= timeout_s + 1.0
        # The acks sent while it was away reached the new controller.
        assert [0, 0, 39] in query_status(stub)["pipelines"]["gone"]["acks"]
    finally:
        for c in nodes:
            c.stop()
        stub.close()


def test_plan_rule_with_a_fake_clock() -> None:
    now = [0.0]
    state = ControllerState(timeout_s=1.0, clock=lambda: now[0])
    for s in range(2):
        state.register({"node_id": f"n{s}", "pipeline": "p", "stage": s, "depth": 2})
    state.ack({"node_id": "n1", "acks": [[0, 0, 9], [0, 1, 2]]})
    state.ack({"node_id": "n0", "acks": [[1, 0, 8], [1, 1, 2]]})
    now[0] = 0.9
    state.heartbeat({"node_id": "n1", "seq": 1})
    now[0] = 1.5
    assert state.sweep() == ["n0"]
    with pytest.raises(RequestError, match="declared dead"):
        state.heartbeat({"node_id": "n0", "seq": 1})
    assert state.plan({"pipeline": "p"})["plan"] is None  # no replacement yet
    state.register({"node_id": "n0b", "pipeline": "p", "stage": 0, "depth": 2})
    plan = state.plan({"pipeline": "p"})["plan"]
    assert plan["resume"] == {"0": 10, "1": 3} and plan["restore"] == [[1, 0]]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ControllerState(0)


def test_a_reported_node_is_declared_dead_only_if_its_address_is_closed() -> None:
    """A stage's transport lost its successor: the controller probes the successor's
    address; closed: dead at once (no heartbeat timeout); still listening: a dropped
    connection between live nodes, which is not a death."""
    closed: set[str] = set()
    state = ControllerState(timeout_s=60.0, probe=lambda address: address not in closed)
    for s in range(2):
        state.register({"node_id": f"n{s}", "pipeline": "p", "stage": s, "depth": 2,
                        "address": f"127.0.0.1:{1000 + s}"})
    assert state.suspect({"node_id": "n0", "stage": 1}) == {"dead": False}
    assert state.status({})["pipelines"]["p"]["failed"] == []
    closed.add("127.0.0.1:1001")
    assert state.suspect({"node_id": "n0", "stage": 1}) == {"dead": True}
    assert state.status({})["pipelines"]["p"]["failed"] == [1]
    assert state.suspect({"node_id": "n0", "stage": 1}) == {"dead": True}  # said once
    assert state.sweep() == []


def test_a_node_reported_lost_is_dead_at_once_and_only_that_incarnation() -> None:
    """Whoever saw a node's process end (its supervisor, its stub) says so: dead now,
    without a probe or the heartbeat timeout; a node the controller never had is left
    alone, and a second report changes nothing."""
    state = ControllerState(timeout_s=60.0, probe=lambda address: True)
    for s in range(2):
        state.register({"node_id": f"n{s}", "pipeline": "p", "stage": s, "depth": 2})
    assert state.lost({"node_id": "n1", "why": "its tritonserver ended"}) == {"dead": True}
    assert state.status({})["pipelines"]["p"] | {"acks": []} == {
        "depth": 2, "state": "paused", "epoch": 1, "failed": [1], "acks": []}
    assert state.lost({"node_id": "n1"}) == {"dead": True}
    assert state.status({})["pipelines"]["p"]["epoch"] == 1  # said once
    assert state.lost({"node_id": "never-registered"}) == {"dead": False}
    assert [n["node_id"] for n in state.status({})["nodes"] if n["alive"]] == ["n0"]
    # Its replacement registers under a new id and is alive.
    state.register({"node_id": "n1-r1", "pipeline": "p", "stage": 1, "depth": 2})
    assert state.plan({"pipeline": "p"})["plan"]["failed"] == [1]


def test_heartbeats_hand_on_the_nodes_whose_processes_ended_once_each() -> None:
    """A T-node frees the KV slots a lost P-node would have written once its beat hears of
    it; a node declared dead by its silence alone may still run, and is not handed on."""
    now = [0.0]
    state = ControllerState(timeout_s=1.0, clock=lambda: now[0], probe=lambda address: True)
    state.register({"node_id": "t0", "pipeline": "decode0", "stage": 0, "depth": 1})
    for p in ("p0", "p1"):
        state.register({"node_id": p, "pipeline": f"prefill{p[1]}", "stage": 0, "depth": 1,
                        "role": "prompt"})
    beat = {"node_id": "t0", "seq": 1, "ended_seen": 0}
    assert state.heartbeat(beat)["ended"] == []
    state.lost({"node_id": "p0", "why": "its tritonserver ended"})
    reply = state.heartbeat({**beat, "seq": 2})
    assert (reply["ended"], reply["ended_seen"]) == (["p0"], 1)
    assert state.heartbeat({**beat, "seq": 3, "ended_seen": 1})["ended"] == []
    now[0] = 2.0
    state.heartbeat({**beat, "seq": 4, "ended_seen": 1})
    assert state.sweep() == ["p1"]  # silent: declared dead, its process not known ended
    assert state.heartbeat({**beat, "seq": 5, "ended_seen": 1})["ended"] == []
    state.lost({"node_id": "p1"})  # then its process ends (the supervisor killed it)
    assert state.heartbeat({**beat, "seq": 6, "ended_seen": 1})["ended"] == ["p1"]
    # A node that knows more than a controller started again is told everything again.
    assert state.heartbeat({**beat, "seq": 7, "ended_seen": 9})["ended"] == ["p0", "p1"]


def test_the_supervisors_pid_watch_reports_a_node_whose_process_ended(controller_factory,
                                                                      tmp_path) -> None:
    """The supervisor sees its node's tritonserver end (here a child standing for it) and
    tells the controller: declared dead within a second, though the node's controller
    client still beats (a stub that outlived its server) and the timeout is 30 s."""
    from orchestrator.cluster.pid_watch import PidWatch, watching
    from orchestrator.cluster.watchdog import write_pid

    _, address = controller_factory(30.0)
    beats = ControllerClient(address, NodeSpec("decode0", 1, 2), SECRET, 0.05,
                             node_id="decode0s1-r0").start()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "cluster.json").write_text(json.dumps({
        "controller": {"address": address},
        "nodes": [{"role": "decode", "pid": server.pid, "config": {"name": "decode0s1-r0"}},
                  {"role": "frontend", "pid": 1, "config": {"name": "frontend"}}]}))
    write_pid(tmp_path, "supervisor", os.getpid())  # this process stands for it
    watch = PidWatch(tmp_path, SECRET)
    assert not watching(tmp_path)
    watch.start()
    try:
        wait_until("the watch to run", lambda: watching(tmp_path))
        wait_until("registration", lambda: any(
            n["node_id"] == "decode0s1-r0" for n in query_status(address, SECRET)["nodes"]))
        assert node(query_status(address, SECRET), "decode0s1-r0")["alive"]
        server.kill()
        detected_s = wait_until("the report", lambda: not node(
            query_status(address, SECRET), "decode0s1-r0")["alive"], timeout_s=5.0)
        assert detected_s < 1.0, detected_s
        assert query_status(address, SECRET)["pipelines"]["decode0"]["failed"] == [1]
        assert watch.reported == {server.pid}
    finally:
        watch.stop.set()
        watch.join(5)
        beats.stop()
        server.kill()
        server.wait(10)
        (tmp_path / "cluster.json").unlink()  # it names this process and init: no cluster


def test_a_killed_process_reads_dying_before_it_is_reaped() -> None:
    """The pid watch does not wait for a killed process to finish its exit (seconds on a
    loaded machine): killed is lost."""
    from orchestrator.cluster.pid_watch import dying

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not dying(process.pid)
        process.kill()
        wait_until("the kill to land", lambda: dying(process.pid), timeout_s=5.0)
    finally:
        process.kill()
        process.wait(10)
    assert not dying(process.pid)  # reaped: nothing to read


def test_listening_tells_a_closed_port_from_an_open_one() -> None:
    import socket

    from orchestrator.fault.controller import listening

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert listening(address)
    assert not listening(address)


def test_a_stage_late_at_start_is_waited_for_one_missing_after_a_restart_is_not() -> None:
    now = [0.0]
    state = ControllerState(timeout_s=1.0, clock=lambda: now[0])
    state.register({"node_id": "a0", "pipeline": "new", "stage": 0, "depth": 2})
    state.register({"node_id": "b0", "pipeline": "ran", "stage": 0, "depth": 2,
                    "rejoin": True})  # a node of a pipeline that ran before this controller
    now[0] = 1.5
    for node_id in ("a0", "b0"):
        state.heartbeat({"node_id": node_id, "seq": 1})
    assert state.sweep() == ["ran/stage1 (never registered)"]


def test_a_replayed_heartbeat_is_refused_and_keeps_no_dead_node_alive(controller_factory
                                                                      ) -> None:
    """An attacker captured a node's signed heartbeat on loopback and replays it after the
    node died: refused (the nonce was seen; a freshly signed repeat of its number is refused
    too), and the node is declared dead at its timeout."""
    from orchestrator.control.auth import sign
    from orchestrator.fault.rpc import AUTH_KEY, SERVICE

    timeout_s = 1.0
    _, address = controller_factory(timeout_s)
    stub = Stub(address, SECRET)
    stub.call("Register", {"node_id": "victim", "pipeline": "rp", "stage": 0, "depth": 1},
              2.0)
    body = json.dumps({"node_id": "victim", "seq": 1}).encode()
    captured = [(AUTH_KEY, sign(SECRET, SERVICE, "Heartbeat", body))]
    channel = grpc.insecure_channel(address)
    heartbeat = channel.unary_unary(f"/{SERVICE}/Heartbeat")
    try:
        heartbeat(body, metadata=captured, timeout=2.0)  # the node's own beat
        died = time.monotonic()  # the node sends no more
        replays = 0
        while node(query_status(address, SECRET), "victim")["alive"]:
            assert time.monotonic() - died < timeout_s + 5, "a replay kept the node alive"
            with pytest.raises(grpc.RpcError, match="replayed") as info:
                heartbeat(body, metadata=captured, timeout=2.0)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError, match="repeats or precedes") as info:
                stub.call("Heartbeat", {"node_id": "victim", "seq": 1}, 2.0)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            replays += 1
            time.sleep(0.05)
        assert replays > 0
    finally:
        channel.close()
        stub.close()
