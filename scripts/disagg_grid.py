"""The disaggregation headline's grid in the serving simulator: every layout `dejavu bench
disagg` compares, on the same arrivals, at fractions of the colocated capacity.

    python scripts/disagg_grid.py --profile splitwise-llama2-70b-h100 --machines 8 \\
        --batch 16 --requests 200 --loads 0.5 1.0 1.5 > grid.md

Per trace (the Azure conversation and code traces, the Mooncake conversation trace's
lengths without its prefix reuse) the rates are ``--loads`` x the capacity model's
colocated whole-prompt requests/s on the same requests (the bench's rates). The layouts:
colocated whole-prompt, colocated chunked at each ``--prefill-chunks`` budget, the two
Splitwise pools and the DejaVu split with the most capacity-model requests/s (provisioned
for throughput, as Splitwise provisions). Per rate: tokens/s (the run's middle), TTFT and
TBT p50/p99, DistServe's attainment under each ``--slo`` pair and whether the run meets
all of Splitwise's nine SLOs; per layout: goodput under each (bisected up to the layout's
capacity-model rate, as ``dejavu plan --slo-*`` does). Markdown on stdout. Simulated, not
measured: the bench's runs on real tritonservers are the check on it
(docs/bench-disagg.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.planner import workload as wl  # noqa: E402
from orchestrator.planner.capacity import Capacity  # noqa: E402
from orchestrator.planner.planner import Layout, predict_rps  # noqa: E402
from orchestrator.planner.simulator import RequestTimes  # noqa: E402
from orchestrator.planner.slo import (  # noqa: E402
    SLO,
    Candidate,
    SplitwiseSLO,
    candidates,
    goodput,
    search_ceiling,
    simulate,
    splitwise_goodput,
)
from orchestrator.planner.throughput import percentile, rate_between  # noqa: E402
from orchestrator.profiles.profile import EngineProfile, load_profile  # noqa: E402

TRACES = ("conv", "code", "mooncake")


def trace_requests(trace: str, count: int, max_prompt: int) -> list[wl.Request]:
    """``count`` requests of the trace (seed 0, trace order), prompts capped at
    ``max_prompt``."""
    if trace == "mooncake":
        from orchestrator.planner.mooncake import load_mooncake

        pool = [wl.Request(i, 0.0, r.prompt_len, max(1, r.output_len))
                for i, r in enumerate(load_mooncake())]
    else:
        pool = wl.load_trace(trace)
    return [wl.Request(r.id, 0.0, min(max_prompt, r.prompt_len), r.output_len)
            for r in wl.sample(pool, count, 0)]


def layouts(cost: EngineProfile, requests: list[wl.Request], machines: int, batch: int,
            chunks: list[int], max_depth: int) -> list[Candidate]:
    """Colocated (whole and chunked), the two pools and the split with the most capacity."""
    found = candidates(machines, chunks, batch, max_depth)
    capacity = Capacity.of([(r.prompt_len, r.output_len) for r in requests], cost, batch)
    ranked = sorted((c for c in found if not c.layout.colocated),
                    key=lambda c: -predict_rps(capacity, c.layout))
    pools = [c for c in ranked if c.family == "Splitwise pools"][:2]
    split = [c for c in ranked if c.family == "DejaVu split"][:1]
    return [c for c in found if c.layout.colocated] + pools + split


def row_of(times: list[RequestTimes], cost: EngineProfile, slos: list[SLO]) -> list[str]:
    ttft = [t.first_token - t.request.arrival for t in times]
    tbt = [g for t in times for g in t.tbts()]
    tok_s = rate_between([s for t in times for s in t.stamps()[1:]])
    attained = [sum(not any(slo.misses(t)) for t in times) / len(times) for slo in slos]
    missing = SplitwiseSLO().misses(cost, times)
    return [f"{tok_s:.0f}", f"{percentile(ttft, 50):.2f} / {percentile(ttft, 99):.2f}",
            f"{1e3 * percentile(tbt, 50):.1f} / {1e3 * percentile(tbt, 99):.1f}",
            *(f"{a:.0%}" for a in attained),
            "all 9 met" if not missing else f"no: {missing[0]}" + (
                f" (+{len(missing) - 1})" if len(missing) > 1 else "")]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="splitwise-llama2-70b-h100")
    ap.add_argument("--machines", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    ap.add_argument("--traces", nargs="+", choices=TRACES, default=list(TRACES))
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--max-depth", type=int, default=4,
                    help="the model's layers over its stages (the bench's 12-layer model: 4)")
    ap.add_argument("--max-prompt", type=int, default=32768,
                    help="prompts capped here (the H100 profile's largest measured prefill)")
    ap.add_argument("--slo", nargs="+", default=["1:0.05", "10:0.035", "3:0.045"],
                    help="DistServe-style TTFT:TBT pairs, seconds (90%% of requests)")
    args = ap.parse_args(argv)
    cost = load_profile(args.profile)
    slos = [SLO(*map(float, pair.split(":"))) for pair in args.slo]
    names = [f"{s.ttft_s:g} s / {s.tbt_s * 1e3:g} ms" for s in slos]
    for trace in args.traces:
        requests = trace_requests(trace, args.requests, args.max_prompt)
        lengths = [(r.prompt_len, r.output_len) for r in requests]
        colocated = predict_rps(Capacity.of(lengths, cost, args.batch),
                                Layout(args.machines, 1))
        picked = layouts(cost, requests, args.machines, args.batch, args.prefill_chunks,
                         args.max_depth)
        print(f"\n### {trace}: {len(requests)} requests, colocated capacity {colocated:.2f} "
              "req/s\n")
        print("| load | req/s | layout | tok/s | TTFT p50 / p99 s | TBT p50 / p99 ms | "
              + " | ".join(f"met {n}" for n in names) + " | Splitwise SLOs |")
        print("|---:|---:|---|---:|---:|---:|" + "---:|" * len(names) + "---|")
        for load in args.loads:
            rate = load * colocated
            arrivals = wl.poisson(requests, rate, 0)
            for c in picked:
                cells = row_of(simulate(cost, arrivals, c, args.batch), cost, slos)
                print(f"| {load:g}x | {rate:.2f} | {c} | " + " | ".join(cells) + " |")
        high = search_ceiling(cost, requests, args.machines, args.batch)
        capacity = Capacity.of(lengths, cost, args.batch)
        print("\n| layout | capacity req/s | goodput, Splitwise's 9 SLOs | "
              + " | ".join(f"goodput {n}" for n in names) + " |")
        print("|---|---:|---:|" + "---:|" * len(names))
        for c in picked:  # as dejavu plan: no more than the layout sustains
            cap = predict_rps(capacity, c.layout)
            good = [goodput(cost, requests, c, args.batch, s, high, capacity=cap).goodput_rps
                    for s in slos]
            split = splitwise_goodput(cost, requests, c, args.batch, high, capacity=cap)
            print(f"| {c} | {cap:.2f} | {split:.2f} | "
                  + " | ".join(f"{g:.2f}" for g in good) + " |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
