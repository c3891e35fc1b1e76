"""Layouts within a cost budget, on one or two machine types (Splitwise-HA's mixed pools).

The capacity model (:mod:`~orchestrator.planner.capacity`, through
:func:`~orchestrator.planner.planner.predict_rps`) predicts each layout's requests/s; this
module prices the machines and decides, as :mod:`~orchestrator.planner.planner` does for
a machine count. Machine types are engine profiles: each states its machine's
``cost_per_hour``. Three families are enumerated:

- every layout of the planner (colocated pipelines, DejaVu's prompt+token pairs,
  Splitwise's pools) on the token profile's machines;
- the same on the prompt profile's machines, where it is another one (the single-type
  baseline the mixed pools compete with: 8 colocated H100s against 2 H100 + 12 A100);
- the disaggregated layouts with their P-nodes on the prompt profile's machines and the
  rest on the token profile's (Splitwise-HA: H100 prompt machines, A100 token machines).

A profile describes one serving node that holds the whole model (its ``kv_memory_bytes``
is what is left beside the weights), so every pipeline may have depth 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from orchestrator.planner.capacity import Capacity
from orchestrator.profiles.profile import EngineProfile

if TYPE_CHECKING:
    from orchestrator.planner.planner import Layout

T = TypeVar("T")
MAX_MACHINES = 64  # bounds the enumeration: every layout up to this many machines
COST_TIE = 0.01  # costs per request this close count as equal (BudgetPlan.best_cost)


def fleet(layout: Layout, machines: int, token: T, prompt: T | None = None) -> list[T]:
    """The machine type of each of ``machines`` a layout runs on: its P-nodes' machines on
    ``prompt`` where given, the rest (T-nodes, colocated or idle machines) on ``token``."""
    prompt_machines = 0 if layout.colocated or not prompt else (
        layout.replicas * layout.prompt_depth)
    return [prompt or token] * prompt_machines + [token] * (machines - prompt_machines)


def fleet_total(values: Iterable[float | None]) -> float:
    """A per-machine figure (cost per hour, watts) summed over a fleet; NaN where any
    machine's is unknown (a profile that states none), so no total undercounts."""
    listed = list(values)
    known = [v for v in listed if v is not None]
    return float(sum(known)) if len(known) == len(listed) else math.nan


def cost_per_request(per_hour: float, rps: float) -> float:
    """A fleet's cost per hour spread over the requests it serves per second."""
    return per_hour / 3600 / rps if rps > 0 else math.nan


@dataclass(frozen=True)
class Priced:
    """One layout on its machine types, with its price and predicted throughput."""

    layout: Layout
    token: EngineProfile  # the T-nodes' (colocated: every node's) machine type
    prompt: EngineProfile  # the P-nodes' machine type (``token`` where one type)
    cost_per_hour: float
    rps: float

    @property
    def cost_per_request(self) -> float:
        return cost_per_request(self.cost_per_hour, self.rps)

    @property
    def mix(self) -> str:
        """The machine types: ``dgx-a100``, or ``dgx-h100 P + dgx-a100 T``."""
        if self.prompt == self.token:
            return self.token.machine.name
        return f"{self.prompt.machine.name} P + {self.token.machine.name} T"

    @property
    def machines(self) -> str:
        """``2 dgx-h100 + 12 dgx-a100``: machines in use, by type."""
        kinds = fleet(self.layout, self.layout.machines, self.token.machine.name,
                      self.prompt.machine.name)
        counts = {name: kinds.count(name) for name in dict.fromkeys(kinds)}
        return " + ".join(f"{n} {name}" for name, n in counts.items())


@dataclass(frozen=True)
class BudgetPlan:
    budget: float  # cost per hour, in the profiles' unit
    candidates: list[Priced]  # every layout within the budget, most requests/s first

    @property
    def best_rps(self) -> Priced:
        return self.candidates[0]

    @property
    def best_cost(self) -> Priced:
        """The cheapest per request, or the most requests/s among those within
        ``COST_TIE`` of it: n colocated replicas all cost the same per request, and the
        model is good to a few percent, so a near-tie goes to throughput."""
        cheapest = min(c.cost_per_request for c in self.candidates)
        return next(c for c in self.candidates  # most requests/s first
                    if c.cost_per_request <= cheapest * (1 + COST_TIE))

    def best_per_mix(self) -> list[Priced]:
        """The most requests/s on each machine mix (all of one type, or mixed pools)."""
        best: dict[str, Priced] = {}
        for c in self.candidates:
            best.setdefault(c.mix, c)
        return list(best.values())


def _cost(profile: EngineProfile) -> float:
    cost = profile.machine.cost_per_hour
    if cost is None or cost <= 0:
        raise ValueError(f"profile {profile.name} states no cost per hour for its machine")
    return cost


def _within(budget: float, cheapest: float, max_machines: int,
            max_depth: int | None) -> list[Layout]:
    """Every layout of the planner on up to as many machines as the budget buys at
    ``cheapest`` each (at most ``max_machines``), each once."""
    from orchestrator.planner.planner import layouts  # imports torch: not for fleet's users

    count = min(max_machines, math.floor(budget / cheapest + 1e-9))
    found: dict[Layout, None] = {}
    for machines in range(1, count + 1):
        found.update(dict.fromkeys(layouts(machines, 1, 1, max_depth)))
    return list(found)


def plan_budget(lengths: Sequence[tuple[int, int]], batch: int, budget: float,
                token: EngineProfile, prompt: EngineProfile | None = None, m: float = 1.0,
                max_machines: int = MAX_MACHINES, max_depth: int | None = None) -> BudgetPlan:
    """Every layout whose machines cost at most ``budget`` per hour, scored by the capacity
    model on ``lengths`` (prompt, output), most requests/s first. ``prompt``: the P-nodes'
    machine type where it is another one."""
    from orchestrator.planner.planner import predict_rps  # as _within

    if budget <= 0 or max_machines < 1:
        raise ValueError(f"need a positive budget and max machines, got {budget}, {max_machines}")
    # (token type, prompt type, capacity, disaggregated only): the docstring's families.
    families: list[tuple[EngineProfile, EngineProfile, Capacity, bool]] = [
        (token, token, Capacity.of(lengths, token, batch, m), False)]
    if prompt is not None and prompt != token:
        families += [
            (prompt, prompt, Capacity.of(lengths, prompt, batch, m), False),
            (token, prompt, Capacity.of(lengths, token, batch, m, prompt_cost=prompt), True)]
    candidates = []
    for tok, pro, capacity, disaggregated_only in families:
        cheapest = min(_cost(tok), _cost(pro))
        for layout in _within(budget, cheapest, max_machines, max_depth):
            if disaggregated_only and layout.colocated:
                continue  # a colocated layout on the token type is the first family's
            price = fleet_total(fleet(layout, layout.machines, _cost(tok), _cost(pro)))
            if price <= budget + 1e-9:  # a budget of 8 x 4.76 buys 8 at 4.76 (float sums)
                candidates.append(Priced(layout, tok, pro, price,
                                         predict_rps(capacity, layout)))
    if not candidates:
        raise ValueError(f"no layout fits a budget of {budget:g} per hour")
    # Ties (the slower pool bounds a disaggregated layout, so extra machines of the other
    # may add nothing) go to the cheaper, then fewer machines, then shallower pipelines.
    candidates.sort(key=lambda c: (-c.rps, c.cost_per_hour, c.layout.machines,
                                   c.layout.deepest))
    return BudgetPlan(budget, candidates)
