"""Pool sizing: from a :class:`Profile` and D machines to a :class:`Plan`.

The planner only computes; ``dejavu up --spec FILE`` acts on what it writes.
It scores every layout that fits in memory, normalised to seconds per D
microbatches so layouts of different shapes compare: ``replicas`` copies of a
colocated pipeline or of a prompt+token pair (DejaVu's), or Splitwise's pools (P
P-nodes and T depth-1 T-nodes); leftover machines idle. No pipeline is deeper
than the model has layers. Scores come from DejaVu's formulas
(:mod:`~orchestrator.planner.formulas`), or, given one, from the capacity model
(:mod:`~orchestrator.planner.capacity`: the engine profile scheduled as the
serving system schedules), which predicts; this module only decides.

Cluster spec (JSON, ``Plan.to_spec``), version 1::

    {
      "version": 1,
      "model_dir": "/path/to/model",       # HF folder every node loads
      "mode": "disaggregated",              # or "colocated"
      "prefill": {"pipelines": 1, "depth": 2},   # P-worker pipelines; null when colocated
      "decode":  {"pipelines": 1, "depth": 6},   # T-worker pipelines; run prompts too when
                                                 # colocated
      "machines": 8,                        # D; machines not in a pipeline stay idle
      "batch": 8, "prompt_len": 512, "new_tokens": 128,   # the workload planned for
      "planner": {"profile": {...}, ...}    # every number behind the decision; the
                                            # profile also calibrates ``dejavu simulate``
    }

A pipeline of depth d splits the model's layers with ``StageSpec.split(L, d)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.planner import formulas as F
from orchestrator.planner.capacity import Capacity
from orchestrator.planner.perf_model import Profile

SPEC_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """``replicas`` x a colocated pipeline, or x a prompt pipeline feeding a token pipeline;
    with ``token_pipelines``, Splitwise's pools: ``replicas`` P-nodes and that many token
    pipelines (any P-node feeds any of them)."""

    replicas: int
    prompt_depth: int  # colocated: the pipeline's depth
    token_depth: int | None = None  # None: colocated
    token_pipelines: int | None = None  # None: ``replicas``

    def __post_init__(self) -> None:
        if self.token_pipelines is not None and self.token_depth is None:
            raise ValueError("a colocated layout has no separate token pipelines")

    @classmethod
    def pools(cls, prompt: int, token: int) -> Layout:
        """Splitwise's: ``prompt`` P-nodes and ``token`` T-nodes, one machine each."""
        if min(prompt, token) < 1:
            raise ValueError(f"pools need a P-node and a T-node at least, got {prompt}, {token}")
        return cls(prompt, 1, 1, token)

    @property
    def colocated(self) -> bool:
        return self.token_depth is None

    @property
    def token_count(self) -> int:
        """Token pipelines (colocated: the pipelines)."""
        return self.replicas if self.token_pipelines is None else self.token_pipelines

    @property
    def is_pools(self) -> bool:
        return self.token_pipelines is not None

    @property
    def machines(self) -> int:
        return self.replicas * self.prompt_depth + self.token_count * (self.token_depth or 0)

    @property
    def deepest(self) -> int:
        return max(self.prompt_depth, self.token_depth or 0)

    def __str__(self) -> str:
        if self.colocated:
            return f"{self.replicas}x colocated depth {self.prompt_depth}"
        if self.is_pools:
            return f"{self.replicas}P+{self.token_count}T pools"
        return f"{self.replicas}x (P{self.prompt_depth}+T{self.token_depth})"


@dataclass(frozen=True)
class Scored:
    layout: Layout
    inverse_throughput: float  # seconds per D microbatches
    rps: float  # requests/s predicted


@dataclass(frozen=True)
class Plan:
    profile: Profile
    machines: int
    min_prompt_depth: int
    min_token_depth: int
    threshold: float  # (D-1)/(D(2-m)-1)
    inequality_says_disaggregate: bool  # the real-valued condition
    real_split: tuple[float, float]  # (D_p, D_t) before rounding
    I_c: float  # one colocated pipeline of depth D
    candidates: list[Scored]  # best first
    model: str = "formulas"  # what scored them: "formulas" or "capacity"

    @property
    def best(self) -> Scored:
        return self.candidates[0]

    @property
    def layout(self) -> Layout:
        return self.best.layout

    @property
    def ratio(self) -> float:
        return self.profile.Y / self.profile.t

    def numbers(self) -> dict:
        return {
            "D": self.machines, "profile": self.profile.to_dict(), "Y/t": self.ratio,
            "D_p_min": self.min_prompt_depth, "D_t_min": self.min_token_depth,
            "threshold": self.threshold,
            "inequality_says_disaggregate": self.inequality_says_disaggregate,
            "real_D_p": self.real_split[0], "real_D_t": self.real_split[1],
            "I_c": self.I_c, "chosen": str(self.layout),
            "chosen_inverse_throughput": self.best.inverse_throughput, "model": self.model,
            "candidates": [
                {"layout": str(s.layout), "inverse_throughput": s.inverse_throughput,
                 "rps": s.rps}
                for s in self.candidates
            ],
        }

    def to_spec(self, model_dir: str | Path) -> dict:
        lay, w = self.layout, self.profile.workload
        token = {"pipelines": lay.token_count, "depth": lay.token_depth or lay.prompt_depth}
        return {
            "version": SPEC_VERSION,
            "model_dir": str(model_dir),
            "mode": "colocated" if lay.colocated else "disaggregated",
            "prefill": None if lay.colocated
            else {"pipelines": lay.replicas, "depth": lay.prompt_depth},
            "decode": token,
            "machines": self.machines,
            "batch": w.batch, "prompt_len": w.prompt_len, "new_tokens": w.new_tokens,
            "planner": self.numbers(),
        }


def score(profile: Profile, machines: int, layout: Layout) -> float:
    """Inverse throughput of ``layout`` by DejaVu's formulas, in seconds per ``machines``
    microbatches. Pools: each P-node serves a microbatch's prompts per m*Y, each T-node
    its tokens per N*t, and the slower pool bounds."""
    p = profile
    if layout.is_pools:
        per_s = min(layout.replicas / (p.m * p.Y), layout.token_count / (p.N * p.t))
        return machines / per_s
    unit = layout.machines // layout.replicas
    if layout.colocated:
        per_unit = F.colocated_inverse_throughput(unit, p.Y, p.t, p.N)
    else:
        per_unit = F.disaggregated_inverse_throughput(
            unit, layout.prompt_depth, layout.token_depth, p.Y, p.t, p.N, p.m
        )
    # One unit serves ``unit`` microbatches per ``per_unit`` seconds.
    return per_unit * machines / layout.machines


def predict_rps(capacity: Capacity, layout: Layout) -> float:
    """Requests/s of ``layout`` by the capacity model."""
    if layout.colocated:
        return layout.replicas * capacity.colocated_rps(layout.prompt_depth)
    return capacity.disaggregated_rps(layout.replicas, layout.token_count, layout.token_depth)


def layouts(machines: int, min_prompt_depth: int, min_token_depth: int,
            max_depth: int | None = None) -> list[Layout]:
    """Every layout that fits: colocated depth >= D_t min; prompt and token depths >= theirs;
    no pipeline deeper than ``max_depth`` (the model's layers)."""
    cap = max_depth or machines
    found = []
    for unit in range(1, machines + 1):
        replicas = machines // unit
        if min_token_depth <= unit <= cap:
            found.append(Layout(replicas, unit))
        for dp in range(min_prompt_depth, unit - min_token_depth + 1):
            if dp <= cap and unit - dp <= cap:
                found.append(Layout(replicas, dp, unit - dp))
    return found + pool_layouts(machines, min_prompt_depth, min_token_depth)


def pool_layouts(machines: int, min_prompt_depth: int, min_token_depth: int) -> list[Layout]:
    """Splitwise's pools where a whole model fits one machine: P + T = ``machines``, P != T
    (equal pools are DejaVu's replicas x (P1+T1))."""
    if max(min_prompt_depth, min_token_depth) > 1:
        return []
    return [Layout.pools(p, machines - p) for p in range(1, machines)
            if p != machines - p]


def best_split_layouts(profile: Profile, machines: int, dp_min: int, dt_min: int,
                       max_depth: int | None = None) -> list[Layout]:
    """Per unit size, only the integer split the formulas pick (floor/ceil of the optimum),
    or where that is deeper than ``max_depth`` the best split within it."""
    cap = max_depth or machines
    found = []
    for unit in range(dp_min + dt_min, machines + 1):
        replicas = machines // unit
        s = F.integer_split(unit, profile.Y, profile.t, profile.N, profile.m, dp_min, dt_min)
        if max(s.D_p, s.D_t) <= cap:
            found.append(Layout(replicas, s.D_p, s.D_t))
            continue
        within = [Layout(replicas, dp, unit - dp) for dp in range(dp_min, unit - dt_min + 1)
                  if dp <= cap and unit - dp <= cap]
        if within:
            found.append(min(within, key=lambda lay: score(profile, machines, lay)))
    return found


def plan(profile: Profile, machines: int, capacity: Capacity | None = None) -> Plan:
    """Size the pools for ``machines`` machines; raises if no layout fits in memory.

    Without ``capacity`` DejaVu's formulas score the colocated pipelines, the integer
    split per unit size and Splitwise's pools; with it the capacity model scores every
    layout that fits."""
    p = profile
    dp_min = F.min_prompt_depth(p.L, p.W0, p.C0, p.M)
    dt_min = F.min_token_depth(p.L, p.W0, p.C0, p.K0, p.M)
    if dt_min > min(machines, p.L):
        raise ValueError(
            f"the model needs a pipeline of depth >= {dt_min} to fit, only {machines} machines"
            f" and {p.L} layers"
        )
    batch = p.workload.batch
    if capacity is None:
        colocated = [Layout(machines // u, u) for u in range(dt_min, min(machines, p.L) + 1)]
        options = (colocated + best_split_layouts(p, machines, dp_min, dt_min, p.L)
                   + pool_layouts(machines, dp_min, dt_min))
        scored = [Scored(lay, i, machines * batch / i)
                  for lay in options for i in [score(p, machines, lay)]]
    else:
        options = layouts(machines, dp_min, dt_min, p.L)
        scored = [Scored(lay, machines * batch / rps, rps)
                  for lay in options for rps in [predict_rps(capacity, lay)]]
    # Ties go to fewer machines in use, then colocated (simpler to run).
    scored.sort(key=lambda s: (s.inverse_throughput, s.layout.machines, not s.layout.colocated))
    return Plan(
        profile=p,
        machines=machines,
        min_prompt_depth=dp_min,
        min_token_depth=dt_min,
        threshold=F.disaggregation_threshold(machines, p.m),
        inequality_says_disaggregate=F.should_disaggregate(machines, p.Y, p.t, p.m),
        real_split=F.optimal_split(machines, p.Y, p.t, p.N, p.m),
        I_c=F.colocated_inverse_throughput(machines, p.Y, p.t, p.N),
        candidates=scored,
        model="formulas" if capacity is None else "capacity",
    )
