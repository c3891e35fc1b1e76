"""``dejavu status``'s exit code: 1 only when a role that serves is down (a spare down, its
replacement loading after a takeover, is a warning)."""

from __future__ import annotations

import pytest

from orchestrator.cluster.launcher import serving


def state(**down: str) -> dict:
    """A 1P+1T cluster with a spare, every node ready and alive but those in ``down``
    (name: what is wrong, "ready" or "controller")."""
    nodes = [{"name": name, "role": role, "ready": True,
              "controller": "-" if role in ("frontend", "spare") else "alive"}
             for name, role in [("frontend", "frontend"), ("prefill0", "prefill"),
                                ("decode0", "decode"), ("spare0", "spare")]]
    for node in nodes:
        if down.get(node["name"]) == "ready":
            node["ready"] = False
        elif down.get(node["name"]) == "controller":
            node["controller"] = "dead"
    return {"nodes": nodes}


@pytest.mark.parametrize(("down", "serves"), [
    ({}, True),
    ({"spare0": "ready"}, True),
    ({"frontend": "ready"}, False),
    ({"prefill0": "ready"}, False),
    ({"decode0": "ready"}, False),
    ({"decode0": "controller"}, False),
])
def test_only_a_role_that_serves_fails_the_status(down, serves):
    assert serving(state(**down), {"nodes": []}) is serves


def test_a_controller_that_does_not_answer_fails_the_status():
    assert serving(state(), {"error": "unreachable (UNAVAILABLE)"}) is False
