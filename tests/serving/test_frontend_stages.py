"""The frontend follows a token pipeline's stages to where the controller says they are."""

from __future__ import annotations

import pytest

from orchestrator.serving.frontend import Frontend
from orchestrator.serving.router import NoNodeError


def registration(address: str, stage: int, alive: bool = True, pipeline: str = "decode0"):
    return {"address": address, "stage": stage, "alive": alive, "pipeline": pipeline}


def test_a_stage_taken_over_by_a_spare_is_reached_at_the_spares_address() -> None:
    frontend = Frontend(["p:1"], [["h:1", "s1:1", "s2:1"]], b"secret")
    try:
        frontend._follow_stages([
            registration("p:1", 0, pipeline="prefill0"),
            registration("s1:1", 1, alive=False),  # the lost node
            registration("spare:1", 1),  # the spare that registered for its slot
            registration("s2:1", 2),
        ])
        assert frontend.later_stages["h:1"] == ["spare:1", "s2:1"]
    finally:
        frontend.close()


def test_a_frontend_started_after_a_takeover_serves_at_the_spares_address(monkeypatch) -> None:
    """Asked before it serves (a frontend started again found the configured address, a
    spare on standby by then, and its first requests failed)."""
    from orchestrator.fault import client

    view = {"nodes": [registration("s1:1", 1, alive=False), registration("spare:1", 1)],
            "pipelines": {}}
    monkeypatch.setattr(client, "query_status", lambda *args, **kwargs: view)
    frontend = Frontend(["p:1"], [["h:1", "s1:1"]], b"secret", controller="c:1",
                        watch_s=3600.0)  # no poll of the watcher's own before the check
    try:
        assert frontend.later_stages["h:1"] == ["spare:1"]
    finally:
        frontend.close()


def test_a_p_node_seen_failing_stays_out_until_the_controller_sees_it_come_back(
        monkeypatch) -> None:
    """The frontend sees a killed P-node's calls fail before the controller declares it
    dead: the controller's 'alive' meanwhile must not put it back (the prompts it reran
    went to it again); its return after a death does."""
    from orchestrator.fault import client

    view = {"nodes": [registration("p:1", 0, pipeline="prefill0"),
                      registration("p:2", 0, pipeline="prefill1")], "pipelines": {}}
    monkeypatch.setattr(client, "query_status", lambda *args, **kwargs: view)
    frontend = Frontend(["p:1", "p:2"], [["h:1"]], b"secret", controller="c:1",
                        watch_s=3600.0)
    try:
        frontend.prefill.mark_down("p:1")  # a call to it failed
        frontend._look(1.0)  # not declared dead yet
        assert frontend.prefill.pick(1) == "p:2"
        view["nodes"][0] = registration("p:1", 0, alive=False, pipeline="prefill0")
        frontend._look(1.0)
        view["nodes"].append(registration("p:1", 0, pipeline="prefill0"))  # started again
        frontend._look(1.0)
        frontend.prefill.leave("p:2")
        assert frontend.prefill.pick(1 << 20) == "p:1"  # p:2 holds the pending tokens
    finally:
        frontend.close()


def test_a_head_taken_over_is_reached_at_the_spares_address_once_repaired(
        monkeypatch) -> None:
    """Stage 0's spare registers before the repair ends: the pipeline stays out of routing
    until the controller's repair is closed, then its requests go to the spare's address
    (the router still names the pipeline by its configured head)."""
    from orchestrator.fault import client

    view = {"nodes": [registration("h:1", 0, alive=False), registration("s1:1", 1),
                      registration("spare:1", 0)],
            "pipelines": {"decode0": {"failed": [0]}}}
    monkeypatch.setattr(client, "query_status", lambda *args, **kwargs: view)
    frontend = Frontend(["p:1"], [["h:1", "s1:1"]], b"secret", controller="c:1",
                        watch_s=3600.0)
    try:
        assert frontend.head_at["h:1"] == "spare:1"
        with pytest.raises(NoNodeError):
            frontend.decode.pick(1)
        view["pipelines"]["decode0"]["failed"] = []
        frontend._look(1.0)
        assert frontend.decode.pick(1) == "h:1"
        assert frontend.decode.revivals == 1  # a request waiting to rerun goes now
    finally:
        frontend.close()
