"""Exhaustive search: simulate every layout that fits, to check the planner's pick."""

from __future__ import annotations

from orchestrator.planner import formulas as F
from orchestrator.planner.perf_model import Profile
from orchestrator.planner.planner import Layout, layouts
from orchestrator.planner.simulator import SimResult, simulate_colocated, simulate_disaggregated
from orchestrator.planner.workload import Request
from orchestrator.profiles.profile import EngineProfile


def simulate_layout(
    profile: Profile, requests: list[Request], layout: Layout, batch: int | None = None,
    cost: EngineProfile | None = None,
) -> SimResult:
    if layout.colocated:
        return simulate_colocated(profile, requests, layout.prompt_depth, layout.replicas, batch,
                                  cost)
    return simulate_disaggregated(
        profile, requests, layout.prompt_depth, layout.token_depth, layout.replicas, batch, cost
    )


def exhaustive(
    profile: Profile, requests: list[Request], machines: int, batch: int | None = None,
    cost: EngineProfile | None = None,
) -> list[tuple[Layout, SimResult]]:
    """Simulate every layout of ``machines`` that fits in memory, shortest makespan first."""
    p = profile
    dp_min = F.min_prompt_depth(p.L, p.W0, p.C0, p.M)
    dt_min = F.min_token_depth(p.L, p.W0, p.C0, p.K0, p.M)
    found = [(lay, simulate_layout(p, requests, lay, batch, cost))
             for lay in layouts(machines, dp_min, dt_min)]
    return sorted(found, key=lambda x: (x[1].makespan, x[0].machines))
