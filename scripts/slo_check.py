"""The SLOs judged on measured runs, beside the serving simulator on the same requests.

    python scripts/slo_check.py bench_out/chunk-conv splitwise-llama2-70b-h100 \\
        --machines 8 --batch 16 --drain 2 --slo 1:0.05 10:0.035 3:0.045

Reads every ``times-<mode>-<rate>.json`` that ``dejavu bench disagg`` wrote into the
folder. Per layout and SLO pair (TTFT seconds : mean TBT seconds): the share of requests
that met both, and **SLO req/s**, those requests over the span of the arrivals (a request
cut at the drain met nothing); then the same from the serving simulator replaying the
very requests (arrivals, lengths, the drain's cut): what ``dejavu plan --slo-*`` ranks
layouts by, at this one rate. Markdown on stdout.

Then each run's **step overhead**, the serving path's time per step that ``dejavu plan
--step-overhead-ms`` takes: the measured mean gap between tokens minus the simulator's
(profile alone) on the same requests, averaged over requests (as the SLO judges them),
over every gap, and over every gap but each request's first; and the first gap's own
excess (disaggregated: the hand-off from the P-node's first token to the T-node's first
step), which a short request's mean gap carries whole (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.planner.planner import Layout  # noqa: E402
from orchestrator.planner.simulator import RequestTimes  # noqa: E402
from orchestrator.planner.slo import SLO, Candidate, simulate  # noqa: E402
from orchestrator.planner.workload import Request  # noqa: E402
from orchestrator.profiles.profile import load_profile  # noqa: E402


def candidate_of(mode: str, layout: str, machines: int) -> Candidate:
    if mode == "colocated":
        return Candidate(Layout(machines, 1))
    if mode.startswith("colocated-chunk"):
        return Candidate(Layout(machines, 1), int(mode.removeprefix("colocated-chunk")))
    if m := re.fullmatch(r"(\d+)P\+(\d+)T pools", layout):
        return Candidate(Layout.pools(int(m[1]), int(m[2])))
    if m := re.fullmatch(r"(\d+)x \(P(\d+)\+T(\d+)\)", layout):
        return Candidate(Layout(int(m[1]), int(m[2]), int(m[3])))
    raise ValueError(f"no candidate for mode {mode!r}, layout {layout!r}")


def met(slo: SLO, arrival: float, stamps: list[float], asked: int, cut_at: float) -> bool:
    """Finished all it asked by ``cut_at``, first token and mean gap within the SLOs."""
    if len(stamps) - 1 < asked or stamps[-1] > cut_at:
        return False
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return (stamps[1] - arrival <= slo.ttft_s
            and (not gaps or statistics.fmean(gaps) <= slo.tbt_s))


def mean_gap(stamps: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.fmean(gaps) if gaps else None


def step_overhead(runs: list, alone: list[RequestTimes]) -> tuple[float, float, float, float]:
    """Mean of the measured gaps minus the simulated ones, seconds: per request, per gap,
    per gap after each request's first; and the first gaps' mean excess."""
    by_request, first, excess, later_excess, gaps, later = [], [], 0.0, 0.0, 0, 0
    for (_, _, measured), sim in zip(runs, alone, strict=True):
        simulated = sim.stamps()
        m, s = mean_gap(measured), mean_gap(simulated)
        if m is None or s is None:
            continue
        by_request.append(m - s)
        excess += (measured[-1] - measured[1]) - (simulated[-1] - simulated[1])
        gaps += len(measured) - 2
        first.append((measured[2] - measured[1]) - (simulated[2] - simulated[1]))
        if len(measured) > 3:
            later_excess += (measured[-1] - measured[2]) - (simulated[-1] - simulated[2])
            later += len(measured) - 3
    return (statistics.fmean(by_request), excess / gaps, later_excess / max(1, later),
            statistics.fmean(first))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("profile")
    ap.add_argument("--machines", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--drain", type=float, default=2.0)
    ap.add_argument("--step-overhead-ms", type=float, default=0.0,
                    help="the serving path's time per step beyond the profile's (simulated)")
    ap.add_argument("--slo", nargs="+", default=["1:0.05", "10:0.035", "3:0.045"],
                    help="TTFT:TBT pairs, seconds")
    args = ap.parse_args(argv)
    cost = load_profile(args.profile)
    slos = [SLO(*map(float, pair.split(":"))) for pair in args.slo]
    print("| SLO TTFT / TBT | layout | rate req/s | measured met | measured SLO req/s "
          "| simulated met | simulated SLO req/s | simulated / measured |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows, overheads = [], []
    for path in sorted(args.folder.glob("times-*.json")):
        mode, rate = path.stem.removeprefix("times-").rsplit("-", 1)
        data = json.loads(path.read_text())
        runs = data["requests"]
        requests = [Request(i, t[0], p, n) for i, (p, n, t) in enumerate(runs)]
        last = max(r.arrival for r in requests)
        span, cut_at = last - min(r.arrival for r in requests), last + args.drain
        candidate = candidate_of(mode, data["layout"], args.machines)
        simulated: list[RequestTimes] = simulate(cost, requests, candidate, args.batch,
                                                 args.step_overhead_ms / 1e3)
        alone = (simulate(cost, requests, candidate, args.batch) if args.step_overhead_ms
                 else simulated)
        overheads.append((str(candidate), float(rate), *step_overhead(runs, alone)))
        for slo in slos:
            measured = [met(slo, t[0], t, n, cut_at) for _, n, t in runs]
            sim = [met(slo, s.request.arrival, s.stamps(), s.request.output_len, cut_at)
                   for s in simulated]
            m_rps, s_rps = sum(measured) / span, sum(sim) / span
            rows.append((slo.ttft_s, slo.tbt_s, str(candidate), float(rate),
                         sum(measured) / len(runs), m_rps, sum(sim) / len(sim), s_rps))
    for ttft, tbt, name, rate, m_met, m_rps, s_met, s_rps in sorted(rows):
        ratio = f"{s_rps / m_rps:.2f}" if m_rps else "-"
        print(f"| {ttft:g} s / {tbt * 1e3:g} ms | {name} | {rate:.2f} | {m_met:.0%} | "
              f"{m_rps:.2f} | {s_met:.0%} | {s_rps:.2f} | {ratio} |")
    print("\n| layout | rate req/s | step overhead ms, by request | by gap | by gap after the "
          "first | first gap's excess ms |\n|---|---:|---:|---:|---:|---:|")
    for name, rate, *overhead in sorted(overheads):
        print(f"| {name} | {rate:.2f} | " + " | ".join(f"{o * 1e3:.2f}" for o in overhead) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
