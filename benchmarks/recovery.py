"""Recovery benchmark (DejaVu Fig. 14 and 15): replicas + four-step recovery vs restart.

Runs the T-nodes' own code in one process: stage nodes over the in-process transport
(:class:`~orchestrator.pipeline.local.LocalPipeline`, colocated) with their replicas,
controller clients and recovery steps (:class:`~orchestrator.fault.local.ReplicatedPipeline`:
a lost stage's slot goes to a hot spare). Fig. 14: the
cumulative latency of one microbatch, a stage killed at step k, with KV
replication and recovery vs restart-from-scratch, each against its own
failure-free run. Fig. 15: requests completed over time, stages killed at three
points of a longer stream. The controller is a real process; failure detection
is its heartbeat timeout, measured, and reported apart from the repair itself.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orchestrator.engine.checkpoint import make_checkpoint
from orchestrator.engine.reference import load_stages
from orchestrator.engine.torch_engine import TorchEngine
from orchestrator.fault.controller import spawn
from orchestrator.fault.local import SECRET, Kill, Recovery, ReplicatedPipeline
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.pipeline.sequence import FinishReason, Sequence

PAPER = {"recovery": 1.24, "restart": 1.91}


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    step_done: dict[int, list[tuple[int, float]]]  # microbatch -> (step, seconds since start)
    finished: list[tuple[float, str]]  # (seconds since start, request id)
    recoveries: list[Recovery] = field(default_factory=list)


@dataclass
class Run:
    name: str
    replicate: bool
    kills: list[Kill]
    # Fig. 15: stage 1 + i % (D - 1) dies once this many of the run's tokens were generated (each
    # position counted once: tokens a restart generates again do not move it on).
    kill_at: list[int] = field(default_factory=list)
    result: RunResult | None = None
    wall_s: float = 0.0


def run_pipeline(args, engines: list[TorchEngine], controller: str, run: Run,
                 prompts: list[list[int]]) -> None:
    # The controller decides a stage is lost; a node's own silence timeout stays out of it.
    config = PipelineConfig(args.depth, args.batch, mode="colocated",
                            dead_after_s=30 * args.timeout_s, recover_timeout_s=120.0)
    pipeline = LocalPipeline(engines, config)
    ft = ReplicatedPipeline(pipeline, controller, f"{run.name}-{time.monotonic_ns()}",
                            replicate=run.replicate, kills=run.kills,
                            heartbeat_s=args.heartbeat_s)
    finished: list[tuple[float, str]] = []
    later = list(enumerate(run.kill_at))
    reached: dict[str, int] = {}  # request -> most tokens it ever had

    def on_token(seq: Sequence, token: int | None, done: bool) -> None:
        reached[seq.request_id] = max(reached.get(seq.request_id, 0), len(seq.output_ids))
        while later and sum(reached.values()) >= later[0][1]:  # a stage dies at its next step
            ft.inject(Kill(stage=1 + later.pop(0)[0] % (args.depth - 1), settled=False))
        if done:
            finished.append((time.monotonic() - ft.started_at, seq.request_id))

    seqs = [Sequence(f"r{i}", p, args.tokens, on_token=on_token) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with ft:
        for seq in seqs:
            pipeline.submit(seq)
        pipeline.wait(600)
        run.wall_s = time.perf_counter() - start
    failed = [s for s in seqs if s.finish_reason is not FinishReason.LENGTH]
    if failed or ft.errors:
        raise RuntimeError(f"{run.name}: {len(failed)} requests failed: "
                           f"{failed[0].error if failed else ft.errors}")
    step_done: dict[int, list[tuple[int, float]]] = {}
    for mb, step, t in ft.steps_done:
        step_done.setdefault(mb, []).append((step, t))
    run.result = RunResult({s.request_id: s.output_ids for s in seqs}, step_done, finished,
                           ft.recoveries)
    print(f"  {run.name}: {run.wall_s:.2f}s", flush=True)


def microbatch_latency(result: RunResult, j: int) -> float:
    """Seconds from the run's start until microbatch ``j`` produced its last token."""
    return result.step_done[j][-1][1]


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(count)]


def fig14(args, engines, controller: str, vocab: int) -> list[Run]:
    """One round of microbatches; stage 1 dies at microbatch 0's step k."""
    prompts = make_prompts(args.batch * args.depth, args.prompt, vocab)
    kill = [Kill(stage=1 % args.depth, microbatch=0, step=args.fail_step, settled=False)]
    runs = [Run("recovery, no failure", True, []), Run("recovery, failure", True, kill),
            Run("restart, no failure", False, []), Run("restart, failure", False, kill)]
    for run in runs:
        run_pipeline(args, engines, controller, run, prompts)
    base = runs[0].result.outputs
    for run in runs[1:]:
        if run.result.outputs != base:
            raise AssertionError(f"{run.name}: tokens differ from the failure-free run")
    return runs


def fig15(args, engines, controller: str, vocab: int) -> list[Run]:
    """A stream of requests, microbatches refilled as they finish; three failures."""
    prompts = make_prompts(args.batch * args.depth * args.rounds, args.prompt, vocab, seed=1)
    # Stage 1 + i % (D - 1) dies a quarter, half, three quarters of the way (stage 0 holds
    # the head: its loss reruns requests elsewhere); mid-request: 3 rounds.
    at = [len(prompts) * args.tokens * (i + 1) // 4 for i in range(3)]
    runs = [Run("no failure", True, []), Run("recovery, 3 failures", True, [], at),
            Run("restart, 3 failures", False, [], at)]
    for run in runs:
        run_pipeline(args, engines, controller, run, prompts)
    return runs


def steps_run(result: RunResult) -> int:
    """Microbatch steps executed, redone ones included (the prefill counts as one)."""
    return sum(len(steps) for steps in result.step_done.values())


def in_run_ratio(result: RunResult, fail_step: int) -> float:
    """Latency over the failure-free latency estimated from the same run.

    The time lost is from microbatch 0 finishing step k-1 (before the kill) to it
    finishing step k (after recovery), less one ordinary step interval. Comparing
    runs made minutes apart on shared CPUs mixes in their load; this does not.
    """
    steps = result.step_done[0]
    before = next(i for i, (s, _) in enumerate(steps) if s == fail_step - 1)
    after = next(i for i, (s, _) in enumerate(steps) if s == fail_step)
    gaps = sorted(b[1] - a[1] for a, b in zip(steps[:before], steps[1 : before + 1], strict=True))
    step_s = gaps[len(gaps) // 2] if gaps else 0.0
    lost = steps[after][1] - steps[before][1] - step_s
    latency = steps[-1][1]
    return latency / (latency - lost)


def summarize14(runs: list[Run], fail_step: int) -> list[dict]:
    rows = []
    for free, failed in ((runs[0], runs[1]), (runs[2], runs[3])):
        base = microbatch_latency(free.result, 0)
        for run in (free, failed):
            latency = microbatch_latency(run.result, 0)
            recoveries = run.result.recoveries
            rows.append({
                "scenario": run.name,
                "mb0_latency_s": round(latency, 3),
                "ratio_in_run": round(in_run_ratio(run.result, fail_step), 3)
                if recoveries else 1.0,
                "ratio_vs_free_run": round(latency / base, 3),
                "mb0_steps_run": len(run.result.step_done[0]),
                "detect_s": round(sum(r.detect_s for r in recoveries), 3),
                "repair_s": round(sum(r.repair_s for r in recoveries), 4),
                "resume_step": recoveries[0].resume.get(0) if recoveries else "",
            })
    return rows


def summarize15(runs: list[Run]) -> list[dict]:
    base, base_steps = runs[0].wall_s, steps_run(runs[0].result)
    return [{
        "scenario": run.name,
        "runtime_s": round(run.wall_s, 3),
        "ratio": round(run.wall_s / base, 3),
        "steps_redone": steps_run(run.result) - base_steps,
        "detect_s": round(sum(r.detect_s for r in run.result.recoveries), 3),
        "failures": len(run.result.recoveries),
        "recomputed": sum(r.recompute for r in run.result.recoveries),
    } for run in runs]


def write_outputs(out: Path, runs14: list[Run], rows14, runs15: list[Run], rows15) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("fig14_summary.csv", rows14), ("fig15_summary.csv", rows15)):
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    with open(out / "fig14_timeline.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["scenario", "step", "seconds"])
        for run in runs14:
            writer.writerows([run.name, s, round(t, 5)] for s, t in run.result.step_done[0])
    with open(out / "fig15_completions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["scenario", "seconds", "request"])
        for run in runs15:
            writer.writerows([run.name, round(t, 5), rid] for t, rid in run.result.finished)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs14:
        steps = run.result.step_done[0]
        a.plot(range(len(steps)), [t for _, t in steps], label=run.name)
    a.set(xlabel="microbatch 0 steps executed (redone steps included)",
          ylabel="cumulative latency (s)", title="Fig. 14: failure at step k")
    a.legend()
    for run in runs15:
        times = [t for t, _ in run.result.finished]
        b.step(times, range(1, len(times) + 1), where="post", label=run.name)
        for recovery in run.result.recoveries:
            b.axvline(recovery.at_s, color="k", ls=":", lw=0.8)
    b.set(xlabel="time (s)", ylabel="requests completed", title="Fig. 15: three failures")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "recovery.png", dpi=120)
    plt.close(fig)


def print_tables(rows14: list[dict], rows15: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, rows in (("Fig. 14: microbatch 0 latency, failure at step "
                         f"{args.fail_step} of {args.tokens}", rows14),
                        ("Fig. 15: runtime with three failures", rows15)):
        table = Table(title=title)
        for key in rows[0]:
            table.add_column(key)
        for row in rows:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
    console.print(
        f"paper (OPT-66B, 4 A100 nodes): recovery {PAPER['recovery']}x, restart "
        f"{PAPER['restart']}x. Here: {args.arch}-{args.preset}, depth {args.depth}, CPU, "
        f"detection = heartbeat timeout {args.timeout_s}s, included. On shared CPUs the load "
        "shifts between runs: ratio_in_run compares within one run; steps are exact."
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench recovery",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: make one)")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="requests per microbatch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--fail-step", type=int, help="Fig. 14 failure step (default 60%%)")
    parser.add_argument("--rounds", type=int, default=3, help="Fig. 15: microbatches per slot")
    parser.add_argument("--timeout-s", type=float, default=2.0,
                        help="controller's failure timeout (shared CPUs: keep it >> heartbeat)")
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=Path("bench_out/recovery"))
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.prompt, args.tokens, args.rounds = "tiny", 8, 16, 2
        args.timeout_s, args.heartbeat_s = 1.0, 0.1
    args.fail_step = args.fail_step or max(1, args.tokens * 3 // 5)
    if args.depth < 2 or args.batch < 1 or not 0 < args.fail_step < args.tokens:
        parser.error("need --depth >= 2, --batch >= 1 and 0 < --fail-step < --tokens")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(args.arch, args.preset, tmp)
        engines = load_stages(str(model), args.depth, max_seq_len=args.prompt + args.tokens)
        vocab = engines[0].vocab_size
        proc, controller = spawn(args.timeout_s, SECRET)
        try:
            warmup = make_prompts(args.batch * args.depth, args.prompt, vocab, seed=2)
            run_pipeline(args, engines, controller, Run("warmup", True, []), warmup)  # untimed
            runs14 = fig14(args, engines, controller, vocab)
            runs15 = fig15(args, engines, controller, vocab)
        finally:
            proc.kill()
            proc.wait(timeout=10)
    rows14, rows15 = summarize14(runs14, args.fail_step), summarize15(runs15)
    print_tables(rows14, rows15, args)
    write_outputs(args.out, runs14, rows14, runs15, rows15)
    print(f"wrote {args.out}/fig14_*.csv, fig15_*.csv, recovery.png")
    return 0
