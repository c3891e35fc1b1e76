"""``dejavu plan`` and ``dejavu simulate``."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from orchestrator.cluster.devices import Devices
from orchestrator.engine.config import ModelConfig
from orchestrator.planner import workload as wl
from orchestrator.planner.budget import MAX_MACHINES, BudgetPlan, Priced, plan_budget
from orchestrator.planner.capacity import Capacity
from orchestrator.planner.kv_sink import TRANSPORTS
from orchestrator.planner.perf_model import (
    Profile,
    Workload,
    profile_from_config,
    profile_live,
    timings_from_engine_profile,
)
from orchestrator.planner.planner import Plan, plan
from orchestrator.planner.search import exhaustive
from orchestrator.planner.simulator import SimResult
from orchestrator.profiles.profile import EngineProfile, load_profile

GB = 1e9


def _plan_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dejavu plan",
        description="Profile a model live, size the prompt and token pools, write a cluster spec.",
    )
    ap.add_argument("--model", help="HF model folder (required but with --budget)")
    ap.add_argument("--machines", type=int, help="D, machines available (default 8); with "
                    f"--budget, the most machines a layout may use (default {MAX_MACHINES})")
    ap.add_argument("--memory-gb", type=float, default=80.0, help="M, memory per machine (GB)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128, help="N, tokens generated per request")
    ap.add_argument("--batch", type=int, default=8, help="requests per microbatch")
    ap.add_argument("--dtype", default=None, help="serving dtype for the byte sizes (typed mode)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5, help="profiling repetitions")
    ap.add_argument("--transport", choices=TRANSPORTS, default="nixl",
                    help="what carries the KV when measuring m: nixl to a receiver process "
                    "(as in serving), or local (one process, memmove)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads while profiling (more oversubscribe shared cores)")
    ap.add_argument("--engine-profile", help="take Y and t from this engine profile (a file or "
                    "a shipped name, the emulated engine's cost model) instead of profiling; "
                    "m from --m (default 1)")
    ap.add_argument("--trace", choices=["conv", "code"],
                    help="with --engine-profile: score every layout by the capacity model on "
                    "this Azure trace's lengths (requests/s at saturation, what `dejavu bench "
                    "disagg` measures) instead of DejaVu's formulas at --prompt-len/--new-tokens")
    ap.add_argument("--requests", type=int, default=1000,
                    help="--trace: requests sampled from it; with the SLOs each is replayed "
                    "by the simulator at every rate tried (200 end before a queue near "
                    "capacity builds up: docs/planner.md)")
    ap.add_argument("--budget", type=float, metavar="B",
                    help="with --engine-profile and --trace: every layout whose machines cost "
                    "at most B per hour (the profiles' cost_per_hour unit), scored by the "
                    "capacity model, with its cost per request")
    ap.add_argument("--slo-ttft", type=float, metavar="S",
                    help="with --slo-tbt, --engine-profile and --trace: pick among colocated "
                    "whole-prompt, colocated chunked, Splitwise's pools and DejaVu's split the "
                    "layout of --machines with the most goodput (the highest rate at which "
                    "--attainment of requests get their first token within S seconds and "
                    "their tokens S' apart on average), replayed by the serving simulator")
    ap.add_argument("--slo-tbt", type=float, metavar="S'",
                    help="the TBT SLO: a request's mean time between tokens, seconds")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="--slo-*: the share of requests that must meet both (DistServe's 90%%)")
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[512, 2048],
                    metavar="TOKENS", help="--slo-*: the chunked colocated step budgets compared")
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, metavar="MS",
                    help="--slo-*: the serving path's time per engine step beyond the "
                    "profile's (scheduling, gRPC, the token's relay; 0: the profile alone). "
                    "Near capacity the TTFT tail hangs on it; the emulated cluster here "
                    "measured 0.5 ms at time scale 4 (docs/planner.md)")
    ap.add_argument("--prefill-profile", metavar="Q",
                    help="--budget: the P-nodes' machines run this engine profile "
                    "(Splitwise-HA's mixed pools: P-nodes on Q, the rest on --engine-profile)")
    ap.add_argument("--top", type=int, default=10, help="--budget: rows shown")
    ap.add_argument("--Y", type=float, help="what-if: prompt time (s), skips profiling")
    ap.add_argument("--t", type=float, help="what-if: token step time (s)")
    ap.add_argument("--m", type=float, help="what-if: streaming overhead factor")
    ap.add_argument("--out", type=Path, help="write the cluster spec (JSON) here")
    ap.add_argument("--devices", nargs="+", default=[], metavar="DEVICES",
                    help="one device set per machine (cpu:0 cpu:1 or cuda:0 ...): the spec "
                    "pins each node to its machines' devices")
    return ap


def plan_main(argv: list[str]) -> int:
    from orchestrator.cluster.launcher import spread_devices  # pytriton: only where needed

    ap = _plan_parser()
    args = ap.parse_args(argv)
    typed = [args.Y, args.t, args.m]
    if args.engine_profile and (args.Y is not None or args.t is not None):
        ap.error("--engine-profile gives Y and t: drop --Y and --t")
    if not args.engine_profile and any(v is not None for v in typed) and None in typed:
        ap.error("what-if planning needs all of --Y, --t and --m")
    if args.trace and not args.engine_profile:
        ap.error("--trace scores layouts on an engine profile: give --engine-profile")
    if args.slo_ttft is not None or args.slo_tbt is not None:
        return _plan_slo(ap, args)
    if args.budget is not None:
        return _plan_budget(ap, args)
    if args.prefill_profile:
        ap.error("--prefill-profile prices mixed machines: give --budget")
    if not args.model:
        ap.error("--model is required (but with --budget)")
    if args.machines is None:
        args.machines = 8
    try:
        machines = [Devices.parse(d) for d in args.devices]
        workload = Workload(args.prompt_len, args.new_tokens, args.batch)
        if args.machines < 1 or args.memory_gb <= 0:
            raise ValueError("--machines must be >= 1 and --memory-gb positive")
        memory = args.memory_gb * GB
        capacity = None
        if args.engine_profile:
            engine_profile = load_profile(args.engine_profile)
            if args.trace:
                capacity = Capacity.of(_trace_lengths(args), engine_profile, args.batch)
                workload = Workload(round(capacity.demand.prompt),
                                    round(capacity.demand.output), args.batch)
            Y, t = timings_from_engine_profile(engine_profile, workload)
            profile = profile_from_config(
                ModelConfig.from_dir(args.model), workload, memory, Y, t,
                1.0 if args.m is None else args.m, args.dtype,
                source=f"engine profile {engine_profile.name}")
            m_raw = None
        elif args.Y is not None:
            cfg = ModelConfig.from_dir(args.model)
            profile = profile_from_config(cfg, workload, memory, args.Y, args.t, args.m, args.dtype)
            m_raw = None
        else:
            torch.set_num_threads(args.threads)
            profile, timings = profile_live(
                args.model, workload, memory, args.device, args.reps, args.transport
            )
            m_raw = timings.m_raw
        result = plan(profile, args.machines, capacity)
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"dejavu plan: error: {e}\n")
    show_plan(result, m_raw)
    if args.out:
        spec = result.to_spec(args.model)
        if machines:
            try:
                spec["devices"] = spread_devices(spec, machines)
            except ValueError as e:
                ap.exit(2, f"dejavu plan: error: {e}\n")
        args.out.write_text(json.dumps(spec, indent=2) + "\n")
        Console().print(f"spec written to {args.out}")
    return 0


def _trace_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (prompt, output) lengths ``--trace`` scores layouts on: ``--requests`` sampled."""
    return [(r.prompt_len, r.output_len)
            for r in wl.sample(wl.load_trace(args.trace), args.requests, 0)]


def _plan_slo(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``dejavu plan --slo-ttft S --slo-tbt S'``: the layout with the most goodput."""
    from orchestrator.planner.slo import SLO, plan_for_slo

    if args.slo_ttft is None or args.slo_tbt is None or not (args.engine_profile and args.trace):
        ap.error("--slo-ttft and --slo-tbt go together, with --engine-profile and --trace")
    if args.budget is not None or args.out or args.Y is not None or args.t is not None:
        ap.error("--slo-* compares layouts of --machines: drop --budget, --out, --Y and --t")
    try:
        slo = SLO(args.slo_ttft, args.slo_tbt, args.attainment)
        requests = wl.sample(wl.load_trace(args.trace), args.requests, 0)
        depth = ModelConfig.from_dir(args.model).num_layers if args.model else None
        result = plan_for_slo(load_profile(args.engine_profile), requests,
                              args.machines or 8, args.batch, slo, args.prefill_chunks, depth,
                              overhead_s=args.step_overhead_ms / 1e3)
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"dejavu plan: error: {e}\n")
    t = Table(title=f"{result.machines} machines on {args.trace}, {args.engine_profile}: goodput "
              f"within TTFT <= {slo.ttft_s:g} s and mean TBT <= {slo.tbt_s:g} s for "
              f"{slo.attainment:.0%} of requests")
    for col in ("layout", "family", "goodput req/s", "limited by", "TTFT missed",
                "TBT missed"):
        t.add_column(col, justify="right" if "missed" in col or "req/s" in col else "left")
    for s in result.scored:
        t.add_row(str(s.candidate), s.candidate.family, f"{s.goodput_rps:.3g}", s.limit,
                  f"{s.ttft_missed:.0%}", f"{s.tbt_missed:.0%}")
    console = Console(width=120)
    console.print(t)
    console.print("missed: the share of requests past each SLO at the rate just above the "
                  "goodput (limited by throughput: at the layout's capacity, the goodput's "
                  "ceiling)")
    console.print(result.reason())
    return 0


def _plan_budget(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``dejavu plan --budget B``: every layout within B per hour, best by requests/s and by
    cost per request. A cluster spec has one machine type, so no --out here."""
    if not (args.engine_profile and args.trace):
        ap.error("--budget scores layouts by the capacity model: give --engine-profile and "
                 "--trace")
    if args.out or args.devices or args.Y is not None or args.t is not None:
        ap.error("--budget plans machines to buy: drop --out, --devices, --Y and --t")
    try:
        token = load_profile(args.engine_profile)
        prompt = load_profile(args.prefill_profile) if args.prefill_profile else None
        # The model's layers cap a pipeline's depth, as in a machine-count plan.
        depth = ModelConfig.from_dir(args.model).num_layers if args.model else None
        result = plan_budget(_trace_lengths(args), args.batch, args.budget, token, prompt,
                             1.0 if args.m is None else args.m,
                             MAX_MACHINES if args.machines is None else args.machines, depth)
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"dejavu plan: error: {e}\n")
    show_budget(result, args.trace, args.top)
    return 0


def show_budget(result: BudgetPlan, trace: str, top: int) -> None:
    best_rps, best_cost = result.best_rps, result.best_cost
    shown = result.candidates[:max(1, top)]
    title = (f"layouts within {result.budget:g}/h on {trace}, scored by capacity: "
             f"{len(shown)} of {len(result.candidates)}, most req/s first")
    if best_cost not in shown:
        shown.append(best_cost)
        title += ", and the cheapest per request"

    def table(title: str, rows: list[Priced]) -> Table:
        t = Table(title=title)
        for col in ("layout", "machines", "cost/h", "req/s", "cost/req", "best"):
            t.add_column(col, justify="right" if col in ("cost/h", "req/s", "cost/req")
                         else "left")
        for c in rows:
            marks = [name for name, best in (("req/s", best_rps), ("cost/req", best_cost))
                     if c is best]
            t.add_row(str(c.layout), c.machines, f"{c.cost_per_hour:.2f}", f"{c.rps:.4g}",
                      f"{c.cost_per_request:.4g}", ", ".join(marks))
        return t

    console = Console(width=120)
    console.print(table(title, shown))
    console.print(table("best per machine mix", result.best_per_mix()))
    for what, c in (("req/s", best_rps), ("cost per request", best_cost)):
        console.print(f"[bold]best by {what}: {c.layout} on {c.machines}, "
                      f"{c.cost_per_hour:.2f}/h, {c.rps:.4g} req/s, "
                      f"{c.cost_per_request:.4g}/req[/bold]")


def show_plan(result: Plan, m_raw: float | None = None) -> None:
    p, console = result.profile, Console()
    table = Table(title="profile", show_header=True)
    for col in ("symbol", "value", "source"):
        table.add_column(col)
    rows = [
        ("L", f"{p.L}", "config"), ("W0", f"{p.W0 / GB:.6g} GB", "config"),
        ("C0", f"{p.C0 / GB:.6g} GB", "config"), ("K0", f"{p.K0 / GB:.6g} GB", "config"),
        ("M", f"{p.M / GB:.6g} GB", "given"), ("N", f"{p.N}", "given"),
        ("Y", f"{p.Y * 1e3:.3f} ms", p.source.get("Y", "")),
        ("t", f"{p.t * 1e3:.3f} ms", p.source.get("t", "")),
        ("m", f"{p.m:.4f}" + (f" (raw {m_raw:.4f})" if m_raw is not None else ""),
         p.source.get("m", "")),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    verdict = "disaggregate" if result.inequality_says_disaggregate else "colocate"
    console.print(
        f"D={result.machines}  D_p >= {result.min_prompt_depth}  D_t >= {result.min_token_depth}  "
        f"Y/t = {result.ratio:.3f}  threshold (D-1)/(D(2-m)-1) = {result.threshold:.3f}  "
        f"-> inequality says {verdict}"
    )
    dp, dt = result.real_split
    console.print(f"real split D_p = {dp:.3f}, D_t = {dt:.3f}; I_c(depth D) = {result.I_c:.4g} s")
    cands = Table(title=f"layouts, scored by {result.model}")
    cands.add_column("layout")
    cands.add_column("I (s per D microbatches)", justify="right")
    cands.add_column("req/s", justify="right")
    for s in result.candidates:
        cands.add_row(str(s.layout), f"{s.inverse_throughput:.4g}", f"{s.rps:.4g}")
    console.print(cands)
    console.print(f"[bold]decision: {result.layout}[/bold]")


def _simulate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dejavu simulate",
        description="Makespan vs machines for colocated, colocated-DP and disaggregated serving.",
    )
    ap.add_argument("--trace", choices=["conv", "code", "synthetic"], default="synthetic")
    ap.add_argument("--machines", default="2-16", help="a range A-B or a comma list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rate", type=float, help="Poisson arrivals per second (default: all at 0)")
    ap.add_argument("--profile", type=Path, help="a spec written by `dejavu plan` to calibrate")
    ap.add_argument("--engine-profile", help="time every pass by this engine profile (file or "
                    "shipped name): the emulated engine's cost model")
    ap.add_argument("--prompt-len", type=int, default=512, help="synthetic prompts")
    ap.add_argument("--new-tokens", type=int, default=128, help="synthetic N")
    ap.add_argument("--early-stops", action="store_true", help="synthetic: stop in 1..N")
    ap.add_argument("--out", type=Path, default=Path("simulate-out"))
    return ap


# What-if calibration when no measured profile is given: a 64-layer model that
# needs 2 machines per token pipeline, prompts 25x a token step.
DEFAULT_PROFILE = Profile(
    L=64, W0=1.6 * GB, C0=0.032 * GB, K0=0.008 * GB, M=80 * GB, Y=0.5, t=0.02, m=1.05,
    workload=Workload(512, 128, 8),
    source=dict.fromkeys(("L", "W0", "C0", "K0", "M", "Y", "t", "m"), "default what-if"),
)


def _machine_counts(text: str) -> list[int]:
    if "-" in text:
        low, high = (int(x) for x in text.split("-"))
        counts = list(range(low, high + 1))
    else:
        counts = [int(x) for x in text.split(",")]
    if not counts or min(counts) < 1:
        raise ValueError(f"bad --machines {text!r}")
    return counts


def _requests(args) -> list[wl.Request]:
    if args.trace == "synthetic":
        reqs = wl.synthetic(args.requests, args.prompt_len, args.new_tokens, args.early_stops,
                            args.seed)
    else:
        reqs = [wl.Request(r.id, 0.0, r.prompt_len, r.output_len)
                for r in wl.sample(wl.load_trace(args.trace), args.requests, args.seed)]
    return wl.poisson(reqs, args.rate, args.seed) if args.rate else reqs


def best_per_policy(profile: Profile, requests: list[wl.Request], machines: int,
                    cost: EngineProfile | None = None) -> dict:
    """The shortest makespan each policy reaches with ``machines``: {policy: (layout, result)}."""
    best: dict[str, tuple] = {}
    for layout, result in exhaustive(profile, requests, machines, cost=cost):
        best.setdefault(result.policy, (layout, result))
    return best


def simulate_main(argv: list[str]) -> int:
    ap = _simulate_parser()
    args = ap.parse_args(argv)
    try:
        counts = _machine_counts(args.machines)
        profile = DEFAULT_PROFILE
        if args.profile:
            profile = Profile.from_dict(json.loads(args.profile.read_text())["planner"]["profile"])
        requests = _requests(args)
        cost = load_profile(args.engine_profile) if args.engine_profile else None
    except (ValueError, FileNotFoundError, KeyError) as e:
        ap.exit(2, f"dejavu simulate: error: {e}\n")
    rows = []
    for machines in counts:
        try:
            best = best_per_policy(profile, requests, machines, cost)
            pick = plan(profile, machines).layout
        except ValueError as e:  # the model does not fit on this few machines
            Console().print(f"D={machines}: {e}")
            continue
        for policy, (layout, result) in best.items():
            rows.append(_row(machines, policy, str(layout), result, layout == pick))
    if not rows:
        ap.exit(2, "dejavu simulate: error: no machine count fits the model\n")
    args.out.mkdir(parents=True, exist_ok=True)
    _write_csv(args.out / "simulate.csv", rows)
    _plot(args.out / "makespan.png", rows, args.trace)
    _print_table(rows)
    Console().print(f"wrote {args.out / 'simulate.csv'} and {args.out / 'makespan.png'}")
    return 0


def _row(machines: int, policy: str, layout: str, r: SimResult, planner_pick: bool) -> dict:
    return {
        "machines": machines, "policy": policy, "layout": layout,
        "makespan_s": r.makespan, "throughput_rps": r.throughput,
        "ttft_p50": r.ttft.p50, "ttft_p90": r.ttft.p90, "ttft_p99": r.ttft.p99,
        "tbt_p50": r.tbt.p50, "tbt_p90": r.tbt.p90, "tbt_p99": r.tbt.p99,
        "machine_seconds": r.machine_seconds, "utilization": r.utilization,
        "planner_pick": planner_pick,
    }


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in sorted({r["policy"] for r in rows}):
        pts = [(r["machines"], r["makespan_s"]) for r in rows if r["policy"] == policy]
        ax.plot(*zip(*pts, strict=True), marker="o", label=policy)
    ax.set_xlabel("machines")
    ax.set_ylabel("makespan (s)")
    ax.set_title(f"makespan vs machines ({title})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(rows: list[dict]) -> None:
    table = Table(title="best layout per policy")
    for col in ("machines", "policy", "layout", "makespan_s", "throughput_rps", "ttft_p99",
                "tbt_p99", "machine_seconds", "planner_pick"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) and not math.isnan(v) else str(v)
                        for v in (r["machines"], r["policy"], r["layout"], r["makespan_s"],
                                  r["throughput_rps"], r["ttft_p99"], r["tbt_p99"],
                                  r["machine_seconds"], r["planner_pick"])))
    Console(width=160).print(table)
