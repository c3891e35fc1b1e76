"""Pool sizing: from a :class:`Profile` and D machines to a :class:`Plan`.

The planner only computes; ``dejavu up --spec FILE`` acts on what it writes.
It scores every layout that fits in memory with DejaVu's inverse throughputs,
normalised to seconds per D microbatches so layouts of different shapes
compare: ``replicas`` copies of a colocated pipeline or of a prompt+token pair,
leftover machines idle.

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
from orchestrator.planner.perf_model import Profile

SPEC_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """``replicas`` x a colocated pipeline, or x a prompt pipeline feeding a token pipeline."""

    replicas: int
    prompt_depth: int  # colocated: the pipeline's depth
    token_depth: int | None = None  # None: colocated

    @property
    def colocated(self) -> bool:
        return self.token_depth is None

    @property
    def machines(self) -> int:
        return self.replicas * (self.prompt_depth + (self.token_depth or 0))

    def __str__(self) -> str:
        if self.colocated:
            return f"{self.replicas}x colocated depth {self.prompt_depth}"
        return f"{self.replicas}x (P{self.prompt_depth}+T{self.token_depth})"


@dataclass(frozen=True)
class Scored:
    layout: Layout
    inverse_throughput: float  # seconds per D microbatches


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
            "chosen_inverse_throughput": self.best.inverse_throughput,
            "candidates": [
                {"layout": str(s.layout), "inverse_throughput": s.inverse_throughput}
                for s in self.candidates
            ],
        }

    def to_spec(self, model_dir: str | Path) -> dict:
        lay, w = self.layout, self.profile.workload
        token = {"pipelines": lay.replicas, "depth": lay.token_depth or lay.prompt_depth}
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
    """Inverse throughput of ``layout`` in seconds per ``machines`` microbatches."""
    p, unit = profile, layout.machines // layout.replicas
    if layout.colocated:
        per_unit = F.colocated_inverse_throughput(unit, p.Y, p.t, p.N)
    else:
        per_unit = F.disaggregated_inverse_throughput(
            unit, layout.prompt_depth, layout.token_depth, p.Y, p.t, p.N, p.m
        )
    # One unit serves ``unit`` microbatches per ``per_unit`` seconds.
    return per_unit * machines / layout.machines


def layouts(machines: int, min_prompt_depth: int, min_token_depth: int) -> list[Layout]:
    """Every layout that fits: colocated depth >= D_t min; prompt and token depths >= theirs."""
    found = []
    for unit in range(1, machines + 1):
        replicas = machines // unit
        if unit >= min_token_depth:
            found.append(Layout(replicas, unit))
        for dp in range(min_prompt_depth, unit - min_token_depth + 1):
            found.append(Layout(replicas, dp, unit - dp))
    return found


def best_split_layouts(profile: Profile, machines: int, dp_min: int, dt_min: int) -> list[Layout]:
    """Per unit size, only the integer split the formulas pick (floor/ceil of the optimum)."""
    found = []
    for unit in range(dp_min + dt_min, machines + 1):
        s = F.integer_split(unit, profile.Y, profile.t, profile.N, profile.m, dp_min, dt_min)
        found.append(Layout(machines // unit, s.D_p, s.D_t))
    return found


def plan(profile: Profile, machines: int) -> Plan:
    """Size the pools for ``machines`` machines; raises if no layout fits in memory."""
    p = profile
    dp_min = F.min_prompt_depth(p.L, p.W0, p.C0, p.M)
    dt_min = F.min_token_depth(p.L, p.W0, p.C0, p.K0, p.M)
    if dt_min > machines:
        raise ValueError(
            f"the model needs a pipeline of depth >= {dt_min} to fit, only {machines} machines"
        )
    colocated = [Layout(machines // u, u) for u in range(dt_min, machines + 1)]
    options = colocated + best_split_layouts(p, machines, dp_min, dt_min)
    scored = sorted(
        (Scored(lay, score(p, machines, lay)) for lay in options),
        # Ties go to fewer machines in use, then colocated (simpler to run).
        key=lambda s: (s.inverse_throughput, s.layout.machines, not s.layout.colocated),
    )
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
    )

