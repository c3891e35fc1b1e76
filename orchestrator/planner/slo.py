"""Picking the layout from the SLOs: the most goodput under a TTFT and a TBT bound.

The candidates on ``machines`` of one engine profile, as ``dejavu bench disagg`` runs them:

- colocated, whole prompts: one pipeline of depth 1 a machine, a prompt run whole in
  the step it joins (the former baseline);
- colocated, chunked: the same machines with a step budget of ``chunk`` tokens (token
  steps plus prompt chunks: Sarathi-Serve's, vLLM's default);
- Splitwise's pools: P P-nodes and T T-nodes, P + T = ``machines``;
- DejaVu's split: R x (a P-node of depth DP feeding a token pipeline of depth DT).

Each is replayed by the serving simulator
(:class:`~orchestrator.planner.simulator.ServingSimulator`, the profile's mixed-step model
for colocated steps) on the same requests at Poisson arrivals. A request meets the SLOs
when its TTFT is at most ``ttft_s`` and its mean time between tokens (TPOT) at most
``tbt_s``, DistServe's per-request attainment. A layout's **goodput** is the highest
arrival rate at which at least ``attainment`` (90%) of the requests meet both (DistServe's
definition), found by bisection up to the layout's capacity (the capacity model's
sustained requests/s: a short replay above it meets a loose TTFT bound only because it
ends before the queue grows); the pick is the layout with the most, and its reason names
the runner-up and what limits each: an SLO it misses at the rate just above its goodput,
or its throughput.

Splitwise's SLOs (:class:`SplitwiseSLO`) judge a run, not a request: the P50, P90 and P99
of TTFT, TBT and end-to-end time, each as a slowdown against the same request on an
unloaded machine, all nine within bounds; :func:`splitwise_goodput` bisects the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.pipeline import check_prefill_chunk
from orchestrator.planner.capacity import Capacity
from orchestrator.planner.planner import Layout, predict_rps
from orchestrator.planner.simulator import RequestTimes, ServingSimulator
from orchestrator.planner.throughput import percentile
from orchestrator.planner.workload import Request, poisson
from orchestrator.profiles.profile import EngineProfile

ATTAINMENT = 0.9  # DistServe's: 90% of the requests within both SLOs
CHUNKS = (512, 2048)  # the step budgets compared by default (vLLM's and Splitwise's 2,048)
# Splitwise (ISCA'24) Table VI: P50 / P90 / P99 slowdown bounds against an unloaded machine.
SPLITWISE_BOUNDS = {"TTFT": (2.0, 3.0, 6.0), "TBT": (1.25, 1.5, 5.0), "E2E": (1.25, 1.5, 5.0)}


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tbt_s: float  # a request's mean time between tokens (TPOT)
    attainment: float = ATTAINMENT

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise ValueError(f"SLOs must be positive, got TTFT {self.ttft_s} s, "
                             f"TBT {self.tbt_s} s")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")

    def misses(self, times: RequestTimes) -> tuple[bool, bool]:
        """(TTFT missed, TBT missed) of one request."""
        ttft = times.first_token - times.request.arrival
        tbts = times.tbts()
        return ttft > self.ttft_s, bool(tbts) and statistics.fmean(tbts) > self.tbt_s


@dataclass(frozen=True)
class SplitwiseSLO:
    """Splitwise's nine SLOs on a run: each latency's P50/P90/P99 slowdown within its bound.
    The unloaded request: its prompt's prefill alone, then batch-1 token steps at its mean
    context (Splitwise measures against an unloaded DGX-A100; here the same machine)."""

    bounds: dict[str, tuple[float, float, float]] = field(
        default_factory=lambda: dict(SPLITWISE_BOUNDS))

    @staticmethod
    def slowdowns(cost: EngineProfile, times: Sequence[RequestTimes]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"TTFT": [], "TBT": [], "E2E": []}
        for t in times:
            p, n = t.request.prompt_len, t.request.output_len
            prefill, step = cost.prefill_s(p), cost.decode_s(1, p + n / 2)
            out["TTFT"].append((t.first_token - t.request.arrival) / prefill)
            out["TBT"] += [gap / step for gap in t.tbts()]
            end = t.tokens[-1] if t.tokens else t.first_token
            out["E2E"].append((end - t.request.arrival) / (prefill + (n - 1) * step))
        return out

    def misses(self, cost: EngineProfile, times: Sequence[RequestTimes]) -> list[str]:
        """The SLOs the run misses, e.g. ``["TBT P99 6.2x > 5x"]``; empty: all nine met."""
        found = []
        for metric, values in self.slowdowns(cost, times).items():
            for q, bound in zip((50, 90, 99), self.bounds[metric], strict=True):
                if values and (got := percentile(values, q)) > bound:
                    found.append(f"{metric} P{q} {got:.2f}x > {bound:g}x")
        return found


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    prefill_chunk: int = 0  # colocated: the step budget; 0: whole prompts

    def __str__(self) -> str:
        if self.layout.colocated and self.layout.prompt_depth == 1:
            steps = (f"{self.prefill_chunk}-token steps" if self.prefill_chunk
                     else "whole prompts")
            return f"{self.layout.replicas}x colocated, {steps}"
        return str(self.layout)

    @property
    def family(self) -> str:
        if self.layout.colocated:
            return "colocated chunked" if self.prefill_chunk else "colocated whole-prompt"
        return "Splitwise pools" if self.layout.is_pools else "DejaVu split"


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    goodput_rps: float  # the highest rate with ``attainment`` of requests within the SLOs
    ttft_missed: float  # at the rate just above it (capped: at it): missing the TTFT SLO
    tbt_missed: float  # ... and the TBT SLO
    capped: bool = False  # the SLOs hold up to the layout's capacity

    @property
    def limit(self) -> str:
        """What stops it from serving more: an SLO, or its throughput."""
        if self.capped or self.ttft_missed == self.tbt_missed == 0:
            return "throughput"
        return "TTFT SLO" if self.ttft_missed >= self.tbt_missed else "TBT SLO"


@dataclass(frozen=True)
class SloPlan:
    slo: SLO
    machines: int
    scored: list[Scored]  # most goodput first

    @property
    def best(self) -> Scored:
        return self.scored[0]

    def best_of(self, family: str) -> Scored | None:
        return next((s for s in self.scored if s.candidate.family == family), None)

    def reason(self) -> str:
        best = self.best
        lines = [f"{best.candidate} ({best.candidate.family}) serves the most within TTFT <= "
                 f"{self.slo.ttft_s:g} s and TBT <= {self.slo.tbt_s:g} s for "
                 f"{self.slo.attainment:.0%} of requests: {best.goodput_rps:.3g} req/s, "
                 f"then limited by its {best.limit}."]
        for family in ("colocated chunked", "colocated whole-prompt", "Splitwise pools",
                       "DejaVu split"):
            other = self.best_of(family)
            if other is None or other is best:
                continue
            ratio = (f"{best.goodput_rps / other.goodput_rps:.2f}x its"
                     if other.goodput_rps > 0 else "where it has none")
            lines.append(f"against the best {family}, {other.candidate}: {ratio} "
                         f"{other.goodput_rps:.3g} req/s (limited by {other.limit})")
        return "\n".join(lines)


def candidates(machines: int, chunks: Sequence[int] = CHUNKS, batch: int = 16,
               max_depth: int | None = None) -> list[Candidate]:
    """Every layout of ``machines`` that the bench runs (pipelines no deeper than
    ``max_depth``, the model's layers)."""
    if machines < 2:
        raise ValueError("comparing layouts needs at least 2 machines")
    for chunk in chunks:
        check_prefill_chunk(chunk, batch)
    cap = max_depth or machines
    found = [Candidate(Layout(machines, 1))]
    found += [Candidate(Layout(machines, 1), chunk) for chunk in chunks]
    found += [Candidate(Layout.pools(p, machines - p)) for p in range(1, machines)]
    for unit in range(2, machines + 1):
        if machines % unit:
            continue
        found += [Candidate(Layout(machines // unit, dp, unit - dp))
                  for dp in range(1, unit) if dp <= cap and unit - dp <= cap]
    return found


def simulate(cost: EngineProfile, requests: list[Request], candidate: Candidate, batch: int,
             overhead_s: float = 0.0) -> list[RequestTimes]:
    """``overhead_s``: the serving path's time per step beyond the profile's
    (:class:`~orchestrator.planner.simulator.ServingSimulator`'s ``step_overhead_s``)."""
    lay = candidate.layout
    sim = ServingSimulator(cost, batch, 0 if lay.colocated else lay.replicas, lay.token_count,
                           lay.prompt_depth if lay.colocated else lay.token_depth,
                           prefill_chunk=candidate.prefill_chunk, step_overhead_s=overhead_s)
    return sim.run(requests)


def missed(cost: EngineProfile, requests: list[Request], candidate: Candidate, batch: int,
           slo: SLO, rate: float, seed: int = 0, overhead_s: float = 0.0
           ) -> tuple[float, float, float]:
    """At ``rate``: the fractions of requests missing (either, TTFT, TBT)."""
    times = simulate(cost, poisson(requests, rate, seed), candidate, batch, overhead_s)
    flags = [slo.misses(t) for t in times]
    n = len(flags)
    return (sum(a or b for a, b in flags) / n, sum(a for a, _ in flags) / n,
            sum(b for _, b in flags) / n)


def highest_rate(meets: Callable[[float], bool], high: float, steps: int = 10
                 ) -> tuple[float, float]:
    """Bisect (0, ``high``] for the highest rate that ``meets``: (the highest found that
    meets, 0 if none; the lowest found that does not, ``high`` if it meets)."""
    if meets(high):
        return high, high
    lo, hi = 0.0, high
    for _ in range(steps):
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def goodput(cost: EngineProfile, requests: list[Request], candidate: Candidate, batch: int,
            slo: SLO, high: float, steps: int = 10, capacity: float | None = None,
            overhead_s: float = 0.0) -> Scored:
    """The highest arrival rate in (0, ``high``] at which ``attainment`` of ``requests``
    meet ``slo`` (DistServe's goodput), no more than ``capacity`` (the rate the layout
    sustains) where given."""
    top = high if capacity is None else min(high, capacity)
    lo, hi = highest_rate(
        lambda rate: missed(cost, requests, candidate, batch, slo, rate, 0, overhead_s)[0]
        <= 1 - slo.attainment, top, steps)
    return Scored(candidate, lo,
                  *missed(cost, requests, candidate, batch, slo, hi, 0, overhead_s)[1:],
                  capped=capacity is not None and lo == top)


def splitwise_goodput(cost: EngineProfile, requests: list[Request], candidate: Candidate,
                      batch: int, high: float, slo: SplitwiseSLO | None = None,
                      steps: int = 10, capacity: float | None = None) -> float:
    """The highest arrival rate in (0, ``high``] (and at most ``capacity``) at which a run
    of ``requests`` meets all nine of Splitwise's SLOs."""
    judge = slo or SplitwiseSLO()
    top = high if capacity is None else min(high, capacity)
    return highest_rate(lambda rate: not judge.misses(cost, simulate(
        cost, poisson(requests, rate, 0), candidate, batch)), top, steps)[0]


def search_ceiling(cost: EngineProfile, requests: list[Request], machines: int,
                   batch: int) -> float:
    """10x what ``machines`` serve if every one ran its prompts and tokens alone: a rate
    no layout reaches, the top of the goodput search."""
    mean_prompt = statistics.fmean(r.prompt_len for r in requests)
    mean_output = statistics.fmean(r.output_len for r in requests)
    alone = cost.prefill_s(round(mean_prompt)) + mean_output * cost.decode_s(
        batch, mean_prompt + mean_output / 2) / batch
    return 10 * machines / alone


def plan_for_slo(cost: EngineProfile, requests: list[Request], machines: int, batch: int,
                 slo: SLO, chunks: Sequence[int] = CHUNKS, max_depth: int | None = None,
                 high: float | None = None, overhead_s: float = 0.0) -> SloPlan:
    """Every candidate's goodput on ``requests`` (their lengths; arrivals are drawn), most
    first, each at most its capacity-model requests/s (chunked colocated: the whole
    prompts', which the mixed step matches to within a few %). ``high``: the highest rate
    tried (default: 10x what the machines serve if every one ran its prompts and tokens
    alone, a bound no layout reaches); ``overhead_s``: the serving path's time per step
    beyond the profile's (:func:`simulate`)."""
    if high is None:
        high = search_ceiling(cost, requests, machines, batch)
    capacity = Capacity.of([(r.prompt_len, r.output_len) for r in requests], cost, batch)
    scored = [goodput(cost, requests, c, batch, slo, high,
                      capacity=predict_rps(capacity, c.layout), overhead_s=overhead_s)
              for c in candidates(machines, chunks, batch, max_depth)]
    # Ties (layouts at the same capacity): fewer requests past the SLOs there, then the
    # simpler layout (colocated first, as listed).
    order = {id(s): i for i, s in enumerate(scored)}
    scored.sort(key=lambda s: (-s.goodput_rps, s.ttft_missed + s.tbt_missed, order[id(s)]))
    return SloPlan(slo, machines, scored)
