"""``dejavu bench pipeline``: bubbles of colocated vs disaggregated token pipelines, and the
largest batch with and without microbatch swapping under a fixed device KV budget.

Output lengths come from the Azure 2023 conversation trace (Splitwise's own; GeneratedTokens,
median ~129) divided by ``--output-scale`` for CPU; prompts have one fixed length, as in
DejaVu §5.2. All requests arrive at once (a makespan run), so early stops and refills decide
the bubbles.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from clients.common import dummy_model, model_arguments, write_csv
from clients.provenance import save_figure
from orchestrator.engine.reference import load_stages
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.pipeline.pipeline import measure_step_time
from orchestrator.pipeline.sequence import FinishReason, Sequence
from orchestrator.pipeline.stage import Interval
from orchestrator.pipeline.swapper import measure_copy_bandwidth, should_swap
from orchestrator.planner.workload import load_trace, sample

CAVEAT = (
    "On 2 shared CPU cores the stage threads compete for the same cores: throughput ratios are "
    "not what a GPU cluster would show. The bubble (idle) fractions from the stage timelines are "
    "the comparable measurement."
)


QUICK = {"preset": "tiny", "requests": 32, "prompt_len": 32, "max_output": 16}


@dataclass
class RunResult:
    name: str
    mode: str
    stages: int
    microbatches: int
    batch: int
    swap: bool
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    ttft_p50_s: float
    stage_busy: str  # per token stage, busy fraction of the run
    mean_busy: float
    prompt_worker_busy: float | None
    kv_budget_bytes: int
    kv_peak_bytes: int
    prefetch_hit: float | None  # swapped: share of sequences already on device when opened


def busy_fraction(timeline: Iterable[Interval], start: float, end: float) -> float:
    busy = sum(max(0.0, min(i.end, end) - max(i.start, start)) for i in timeline)
    return busy / (end - start)


def run(name: str, pipeline: LocalPipeline, prompts: list[list[int]], limits: list[int],
        timeout_s: float) -> tuple[RunResult, list[list[Interval]]]:
    with pipeline:
        start = time.monotonic()
        seqs = [pipeline.submit(Sequence(f"{name}-{i}", p, m))
                for i, (p, m) in enumerate(zip(prompts, limits, strict=True))]
        pipeline.wait(timeout_s)
        end = time.monotonic()
    failed = [s for s in seqs if s.finish_reason is FinishReason.ERROR]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0].error}")
    latencies = sorted(s.finish_time - s.arrival_time for s in seqs)
    busy = [busy_fraction(t, start, end) for t in pipeline.timelines]
    prefill = pipeline.prefill_timeline if pipeline.prompt_engines else None
    config = pipeline.config
    kv = pipeline.kv
    fetched = sum(getattr(k, "prefetched", 0) for k in kv)
    opened = fetched + sum(getattr(k, "swapped_on_demand", 0) for k in kv)
    tokens = sum(len(s.output_ids) for s in seqs)
    result = RunResult(
        name=name, mode=config.mode, stages=config.depth,
        microbatches=config.microbatches, batch=config.batch_size, swap=pipeline.swap,
        requests=len(seqs), tokens=tokens, wall_s=end - start, tokens_per_s=tokens / (end - start),
        latency_p50_s=statistics.median(latencies),
        latency_p90_s=latencies[int(0.9 * (len(latencies) - 1))],
        ttft_p50_s=statistics.median(s.first_token_time - s.arrival_time for s in seqs),
        stage_busy=" ".join(f"{b:.2f}" for b in busy), mean_busy=statistics.mean(busy),
        prompt_worker_busy=busy_fraction(prefill, start, end) if prefill else None,
        kv_budget_bytes=max(a.budget_bytes for a in pipeline.arenas),
        kv_peak_bytes=max(a.peak_bytes for a in pipeline.arenas),
        prefetch_hit=fetched / opened if opened else None,
    )
    timelines = pipeline.timelines + ([list(prefill)] if prefill else [])
    return result, [[_shift(i, start) for i in t] for t in timelines]


def pipeline_of(engines: list, batch: int, prompt_engines: list | None = None,
                **config) -> LocalPipeline:
    """The stages as nodes in this process (``config``: PipelineConfig fields); the
    P-side prefills ``batch`` prompts at a time."""
    return LocalPipeline(engines, PipelineConfig(len(engines), batch, **config),
                         prompt_engines=prompt_engines, prompt_batch=batch)


def _shift(interval: Interval, origin: float) -> Interval:
    return Interval(interval.start - origin, interval.end - origin, interval.microbatch,
                    interval.kind)


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int], str]:
    try:
        trace = sample(load_trace("conv"), args.requests, args.seed)
        lengths = [r.output_len for r in trace]
        source = f"Azure 2023 conv trace GeneratedTokens / {args.output_scale}"
    except FileNotFoundError as e:
        rng = random.Random(args.seed)
        lengths = [int(rng.lognormvariate(4.8, 1.0)) + 1 for _ in range(args.requests)]
        source = f"lognormal(4.8, 1.0) / {args.output_scale} (trace not found: {e})"
    limits = [max(1, min(args.max_output, round(n / args.output_scale))) for n in lengths]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    return prompts, limits, source


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench pipeline", description=__doc__)
    model_arguments(parser, "gpt2", "small")
    parser.add_argument("--stages", type=int, default=2, help="token pipeline depth")
    parser.add_argument("--layers", help="layers per token stage, e.g. 8,4 (default: even); "
                        "the last stage also holds the LM head")
    parser.add_argument("--batch", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-scale", type=float, default=8.0,
                        help="divide the trace's output lengths by this (CPU)")
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--swap-microbatches", type=int, default=4,
                        help="microbatches in flight for the swapping comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("bench_out/pipeline"))
    parser.add_argument("--quick", action="store_true", help="tiny model, few requests")
    args = parser.parse_args(argv)
    if args.quick:  # smaller defaults; options given explicitly still win
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.stages < 1 or args.batch < 1 or args.requests < 1:
        parser.error("--stages, --batch and --requests must be >= 1")
    try:
        layers = [int(n) for n in args.layers.split(",")] if args.layers else None
    except ValueError:
        parser.error(f"--layers takes comma-separated layer counts, got {args.layers!r}")
    torch.set_num_threads(1)  # one core per stage thread, or they fight over both
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or dummy_model(args.out, args.arch, args.preset)
    max_seq = args.prompt_len + args.max_output + 1

    # Engines keep no per-request state (the pipelines own the KV): every run shares them.
    try:
        engines = load_stages(model, args.stages, layers=layers, max_seq_len=max_seq)
    except ValueError as e:
        parser.error(str(e))
    prompt_engines = load_stages(model, 1, max_seq_len=max_seq)
    prompts, limits, source = workload(args, engines[0].vocab_size)
    split = [e.stage.count for e in engines]
    print(f"model {model} ({args.arch}/{args.preset}), token stages of {split} layers, "
          f"batch {args.batch}, {args.requests} requests, prompt {args.prompt_len} tokens")
    print(f"output lengths: {source}: median {statistics.median(limits)}, max {max(limits)}")
    y, t = _prompt_and_step_time(engines, args.batch, args.prompt_len)
    print(f"measured per stage: prompt (batch {args.batch}) Y = {y * 1e3:.1f} ms, "
          f"token step t = {t * 1e3:.1f} ms, Y/t = {y / t:.1f}")

    results, timelines = [], {}
    for name, pipeline in [
        ("colocated", pipeline_of(engines, args.batch, mode="colocated")),
        ("disaggregated", pipeline_of(engines, args.batch, prompt_engines)),
    ]:
        result, timelines[name] = run(name, pipeline, prompts, limits, args.timeout)
        results.append(result)

    # Swapping: one fixed device KV budget per stage, the largest batch each way.
    mbs = max(args.swap_microbatches, args.stages)
    slot = max(e.kv_layout.slot_bytes() for e in engines)
    budget = mbs * args.batch * slot
    swap_batch = budget // (2 * slot)
    for name, batch, swap in [("resident", args.batch, "off"), ("swapped", swap_batch, "on")]:
        pipeline = pipeline_of(engines, batch, prompt_engines, num_microbatches=mbs, swap=swap,
                               device_kv_budget=budget)
        results.append(run(name, pipeline, prompts, limits, args.timeout)[0])
    bandwidth = measure_copy_bandwidth(engines[0].device)
    token_bytes = engines[0].kv_layout.token_bytes_per_layer() * engines[0].kv_layout.num_layers
    pays = should_swap(max(1, round(statistics.mean(limits))), t, args.prompt_len, args.batch,
                       token_bytes, bandwidth)

    _report(results, args.out)
    _plot(results, timelines, args.out)
    print(f"device KV budget per stage: {budget} B ({mbs} microbatches x batch {args.batch} "
          f"resident, or batch {swap_batch} swapped); copy bandwidth {bandwidth / 1e9:.2f} GB/s; "
          f"Appendix E rule says swapping {'pays' if pays else 'does not pay'} here")
    print(CAVEAT)
    print(f"wrote {args.out / 'pipeline.csv'} and {args.out / 'pipeline.png'}")
    return 0


def _prompt_and_step_time(engines: list, batch: int, prompt_len: int) -> tuple[float, float]:
    """Y and t of the slowest stage, measured on the engines the runs use."""
    ys, ts = [], []
    for engine in engines:
        caches = [engine.new_cache() for _ in range(batch)]
        inputs = ([torch.randint(4, engine.vocab_size, (prompt_len,)) for _ in range(batch)]
                  if engine.stage.is_first else
                  [torch.randn(prompt_len, engine.hidden_size) for _ in range(batch)])
        start = time.perf_counter()
        engine.prefill(inputs, caches)
        ys.append(time.perf_counter() - start)
        ts.append(measure_step_time(engine, batch, prompt_len))
    return max(ys), max(ts)


def _report(results: list[RunResult], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="token pipelines (busy = share of the run a stage computed)")
    for col in ["run", "mb x batch", "swap", "tok/s", "lat p50/p90 s", "ttft p50 s",
                "stage busy", "bubble", "P busy", "KV peak/budget", "prefetch hit"]:
        table.add_column(col)
    for r in results:
        table.add_row(
            r.name, f"{r.microbatches} x {r.batch}", "on" if r.swap else "off",
            f"{r.tokens_per_s:.1f}", f"{r.latency_p50_s:.2f}/{r.latency_p90_s:.2f}",
            f"{r.ttft_p50_s:.2f}", r.stage_busy, f"{1 - r.mean_busy:.2f}",
            "-" if r.prompt_worker_busy is None else f"{r.prompt_worker_busy:.2f}",
            f"{r.kv_peak_bytes / 1e6:.1f}/{r.kv_budget_bytes / 1e6:.1f} MB",
            "-" if r.prefetch_hit is None else f"{r.prefetch_hit:.2f}",
        )
    Console(width=170).print(table)
    write_csv(out / "pipeline.csv", results)


def _plot(results: list[RunResult], timelines: dict[str, list[list[Interval]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"prefill": "tab:red", "decode": "tab:blue", "prefill+decode": "tab:purple"}
    fig, axes = plt.subplots(len(timelines) + 1, 1, figsize=(11, 3 + 2.2 * len(timelines)))
    for ax, (name, rows) in zip(axes, timelines.items(), strict=False):
        span = max((i.end for row in rows for i in row), default=1.0)
        for y, row in enumerate(rows):
            for kind, color in colors.items():
                spans = _merged([i for i in row if i.kind == kind], gap=span / 2000)
                ax.broken_barh(spans, (y - 0.4, 0.8), color=color)
        labels = [f"T{i}" for i in range(len(rows))]
        if name == "disaggregated":
            labels[-1] = "P"
        ax.set_yticks(range(len(rows)), labels)
        ax.set_title(f"{name}: stage timelines (white = bubble)")
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0].legend(handles, list(colors), loc="upper right", fontsize=8)
    ax = axes[-1]
    names = [r.name for r in results]
    ax.bar(names, [1 - r.mean_busy for r in results], color="tab:gray")
    ax.set_ylabel("mean token-stage bubble fraction")
    for i, r in enumerate(results):
        ax.text(i, 1 - r.mean_busy, f"{r.tokens_per_s:.0f} tok/s\nB={r.batch}", ha="center",
                va="bottom", fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "pipeline.png", dpi=110)
    plt.close(fig)


def _merged(intervals: list[Interval], gap: float) -> list[tuple[float, float]]:
    """(start, width) bars, joining intervals closer than ``gap`` (invisible at plot scale)."""
    bars: list[list[float]] = []
    for i in intervals:
        if bars and i.start - bars[-1][1] < gap:
            bars[-1][1] = i.end
        else:
            bars.append([i.start, i.end])
    return [(start, end - start) for start, end in bars]
