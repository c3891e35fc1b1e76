"""Exhaustive search: simulate every layout that fits, to check the planner's pick."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from orchestrator.planner import formulas as F
from orchestrator.planner.perf_model import Profile
from orchestrator.planner.planner import Layout, layouts
from orchestrator.planner.simulator import (
    ServingSimulator,
    SimResult,
    simulate_colocated,
    simulate_disaggregated,
)
from orchestrator.planner.throughput import sustained_rps
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
    """Simulate every layout of ``machines`` that fits in memory (DejaVu's: the microbatch
    simulator has no pools), shortest makespan first."""
    p = profile
    dp_min = F.min_prompt_depth(p.L, p.W0, p.C0, p.M)
    dt_min = F.min_token_depth(p.L, p.W0, p.C0, p.K0, p.M)
    found = [(lay, simulate_layout(p, requests, lay, batch, cost))
             for lay in layouts(machines, dp_min, dt_min, p.L) if not lay.is_pools]
    return sorted(found, key=lambda x: (x[1].makespan, x[0].machines))


def saturating(lengths: Sequence[tuple[int, int]], count: int = 1200,
               seed: int = 0) -> list[Request]:
    """``count`` requests drawn from ``lengths`` (prompt, output), in random order (a
    stationary workload), all queued at once: the system at saturation."""
    rng = random.Random(seed)
    return [Request(i, 0.0, *rng.choice(lengths)) for i in range(count)]


def simulate_serving(cost: EngineProfile, requests: list[Request], layout: Layout, batch: int,
                     m: float = 1.0, cut_at: float = math.inf,
                     prompt_cost: EngineProfile | None = None, hit_rate: float = 0.0,
                     prefill_chunk: int = 0) -> float:
    """Sustained requests/s of ``layout`` in the serving simulator (the event-driven twin of
    the capacity model), measured as the bench measures a run; tokens after ``cut_at``
    (a run's drain cut) do not count; ``prompt_cost``: the P-nodes' own profile;
    ``hit_rate``: the prompt tokens the prefix caches hold; ``prefill_chunk``: colocated,
    the step budget (0: whole prompts)."""
    prompt_nodes = 0 if layout.colocated else layout.replicas
    depth = layout.prompt_depth if layout.colocated else layout.token_depth
    sim = ServingSimulator(cost, batch, prompt_nodes, layout.token_count, depth, m,
                           prompt_cost=prompt_cost, hit_rate=hit_rate,
                           prefill_chunk=prefill_chunk)
    times = [[t for t in r.stamps() if t <= cut_at] for r in sim.run(requests)]
    return sustained_rps(times, [r.output_len for r in requests])
