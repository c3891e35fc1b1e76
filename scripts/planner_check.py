"""Predicted against measured: sustained requests/s of layouts on real tritonservers, next to
the planner's capacity model and the serving simulator on one engine profile.

    python scripts/planner_check.py run --layouts colocated colocated-pipeline pools:1:1 \\
        --profile splitwise-llama2-70b-h100 --batch 8 --requests 40 --rate 2 --out runs/check
    python scripts/planner_check.py compare runs/check/times.json PROFILE
    python scripts/planner_check.py table

``table`` prints the planner against the simulator alone (no cluster) on the shipped
profiles, both traces, batch 4 and 16: the table in docs/planner.md.

``run`` keeps every request's times (``times.json``); ``compare`` measures them as the
simulator measures itself (:func:`~orchestrator.planner.throughput.sustained_rps`), beside
the planner and the simulator on the same requests (:func:`clients.disagg.expected`). Layouts:
``colocated`` (a T-node per machine), ``colocated-pipeline`` (one pipeline over all),
``pools:P:T`` (Splitwise's), ``split:R:DP:DT`` (R x a P-node of DP feeding T_DT). Requests
go in random order: the trace's own order drifts in length, and the model assumes a
stationary workload. Omit ``--profile`` to run the torch engine (compare then needs its
profile from ``dejavu profile``, taken as close to the run as the host allows).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.common import dummy_model  # noqa: E402
from clients.disagg import (  # noqa: E402
    Pools,
    cluster_for,
    expected,
    make_jobs,
    replay,
    scaled_requests,
)
from orchestrator.planner.planner import Layout  # noqa: E402
from orchestrator.planner.throughput import sustained_rps  # noqa: E402
from orchestrator.planner.workload import Request, poisson  # noqa: E402


def layout_of(spec: str, machines: int) -> Layout:
    if spec == "colocated":
        return Layout(machines, 1)
    if spec == "colocated-pipeline":
        return Layout(1, machines)
    kind, *numbers = spec.split(":")
    if kind == "pools":
        return Layout.pools(*map(int, numbers))
    replicas, dp, dt = map(int, numbers)
    return Layout(replicas, dp, dt)


def run(args: argparse.Namespace) -> None:
    from orchestrator.cluster.devices import Devices
    from orchestrator.control.auth import load_secret
    from orchestrator.engine.config import ModelConfig

    args.out.mkdir(parents=True, exist_ok=True)
    machines = [Devices.parse(m) for m in args.machines]
    model = dummy_model(args.out, args.arch, args.preset).resolve()
    vocab = ModelConfig.from_dir(model).vocab_size
    lengths = scaled_requests(args.trace, args.requests, 0, args.scale, args.scale,
                              args.max_prompt, args.max_new)
    random.Random(1).shuffle(lengths)
    results: dict = {"batch": args.batch, "machines": len(machines), "rate": args.rate,
                     "lengths": lengths, "runs": []}
    for spec in args.layouts:
        layout = layout_of(spec, len(machines))
        mode = ("colocated" if spec == "colocated" else "colocated-pipeline"
                if spec == "colocated-pipeline" else "disaggregated")
        split = Pools(layout.replicas, layout.token_count) if layout.is_pools else layout
        load_before = os.getloadavg()[0]
        with cluster_for(mode, model, machines, args.out / "cluster", args.batch,
                         args.max_prompt + args.max_new, split, args.profile) as cluster:
            url, secret = cluster.frontend.grpc_url, load_secret(cluster.secret_file)
            replay(url, secret, make_jobs(lengths[:2], 100.0, vocab, 1))  # warm every node
            times = replay(url, secret, make_jobs(lengths, args.rate, vocab, 0))
        results["runs"].append({"layout": spec, "times": times,
                                "load": [load_before, os.getloadavg()[0]]})
        (args.out / "times.json").write_text(json.dumps(results))
        print(f"{spec}: done at {time.strftime('%H:%M:%S')}", flush=True)


def compare(args: argparse.Namespace) -> None:
    from orchestrator.profiles.profile import load_profile

    res = json.loads(args.times.read_text())
    cost, batch = load_profile(args.profile), res["batch"]
    lengths = [tuple(x) for x in res["lengths"]]
    requests = poisson([Request(i, 0.0, p, n) for i, (p, n) in enumerate(lengths)],
                       res["rate"], 0)
    print("| layout | planner req/s | simulator req/s | measured req/s | planner / measured "
          "| simulator / measured | load average |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for entry in res["runs"]:
        layout = layout_of(entry["layout"], res["machines"])
        measured = sustained_rps(entry["times"], [n for _, n in lengths])
        planner, simulated = expected(cost, requests, layout, batch)
        print(f"| {layout} | {planner:.3f} | {simulated:.3f} | {measured:.3f} | "
              f"{planner / measured:.2f} | {simulated / measured:.2f} | "
              f"{entry['load'][0]:.1f}-{entry['load'][1]:.1f} |")


TABLE_LAYOUTS = {"c1": Layout(1, 1), "2x c1": Layout(2, 1), "p2": Layout(1, 2),
                 "p3": Layout(1, 3), "p4": Layout(1, 4), "p8": Layout(1, 8),
                 "1P+1T": Layout(1, 1, 1), "1P+T2": Layout(1, 1, 2),
                 "1P+3T": Layout.pools(1, 3), "3P+1T": Layout.pools(3, 1)}


def table(_args: argparse.Namespace) -> None:
    from orchestrator.planner import workload as wl
    from orchestrator.planner.capacity import Capacity
    from orchestrator.planner.planner import predict_rps
    from orchestrator.planner.search import saturating, simulate_serving
    from orchestrator.profiles.profile import load_profile

    print("| profile | trace | batch | " + " | ".join(TABLE_LAYOUTS) + " |")
    print("|---|---|---:|" + "---:|" * len(TABLE_LAYOUTS))
    for name in ("splitwise-llama2-70b-h100", "splitwise-bloom-176b-a100"):
        cost = load_profile(name)
        for trace in ("conv", "code"):
            lengths = [(r.prompt_len, r.output_len)
                       for r in wl.sample(wl.load_trace(trace), 300, seed=0)]
            requests = saturating(lengths, count=1500)
            for batch in (4, 16):
                capacity = Capacity.of(lengths, cost, batch)
                ratios = [predict_rps(capacity, lay) / simulate_serving(cost, requests, lay, batch)
                          for lay in TABLE_LAYOUTS.values()]
                print(f"| {name.removeprefix('splitwise-')} | {trace} | {batch} | "
                      + " | ".join(f"{r:.2f}" for r in ratios) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--layouts", nargs="+", required=True)
    r.add_argument("--machines", nargs="+", default=["cpu:0", "cpu:1"])
    r.add_argument("--trace", choices=["conv", "code"], default="conv")
    r.add_argument("--requests", type=int, default=40)
    r.add_argument("--rate", type=float, default=2.0, help="offered req/s: above capacity")
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--scale", type=float, default=0.25, help="trace lengths times this")
    r.add_argument("--max-prompt", type=int, default=512)
    r.add_argument("--max-new", type=int, default=64)
    r.add_argument("--arch", default="gpt2")
    r.add_argument("--preset", default="small")
    r.add_argument("--profile", default="", help="emulated engine profile (empty: torch)")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("times", type=Path)
    c.add_argument("profile", help="the engine profile to predict from (file or name)")
    sub.add_parser("table")
    args = ap.parse_args()
    {"run": run, "compare": compare, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
