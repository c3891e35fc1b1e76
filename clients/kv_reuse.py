"""``dejavu bench disagg --trace mooncake``: KV reuse and KV-aware routing on the Mooncake
conversation trace, layouts side by side (NVIDIA Dynamo's ``recipes/qwen3-32b``, emulated).

The trace (:mod:`orchestrator.planner.mooncake`; default: the shipped first 20 minutes)
is replayed at its own timestamps (``--start``, ``--window``, ``--rate-scale``), each
prompt made from its 512-token block ids, so prompts share tokens exactly where the
trace says and the nodes' prefix caches hit them. Every node runs the emulated engine
on ``--profile`` (default: the H100 Llama-2-70B profile) at ``--time-scale K``. The
prompts are long (mean 12,035 tokens): the model is a dummy Llama shaped for it, 2
layers with one KV head of 2 dims (32 bytes of KV per token, the emulated engine's
``kv_scale`` against the profile's, printed), positions for ``--max-prompt`` tokens.
Each prefilling node's cache holds ``--cache-tokens`` tokens (default: half of the
profile machine's KV memory), in blocks of ``--kv-block``.

Per layout (default: Dynamo's four: 8 colocated round-robin without a cache, 8
colocated with the KV router, 6P+2T JSQ, 6P+2T KV router): TTFT p50/p99, ITL p99 (gaps
between tokens), end-to-end p50/p99, prompt tokens computed, the hit rate (prompt tokens
reused over all) against the offline ideal at the same total cache capacity (one cache
that large under Belady's eviction: :func:`~orchestrator.planner.mooncake.ideal_hit_rate`)
and bytes of KV moved P->T (and, with decode-side reuse, those not moved: the T-nodes held
them); and the simulator's TTFT for the layout at its measured hit
rate (:class:`~orchestrator.planner.simulator.ServingSimulator`) and, disaggregated, its
measured dispatch: a request's mean time on the hops to its first token outside the
P-node's queue and prefill (the frontend's T-node admission and P-node calls, less the
P-nodes' own queue and execute times, from their counters). Output: ``kv_reuse.csv``,
``kv_reuse.png``, a table. ``--predict-from CSV``: only the simulator's figures, at the hit
rates of an earlier run's CSV (no cluster).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from clients.common import markdown, metric, write_csv
from orchestrator.planner.throughput import percentile
from orchestrator.serving.config import NodeConfig

KV_BYTES_PER_TOKEN = 32  # the dummy model's: 2 layers x K/V x 1 head x 2 dims x 4 bytes


@dataclass(frozen=True)
class Layout:
    name: str
    prefill: int  # P-nodes (0: colocated)
    decode: int  # token pipelines (colocated: each prefills its own)
    router: str  # jsq, kv, round-robin
    cache: bool = True
    decode_cache: bool = False  # the T-nodes keep finished requests' KV (decode-side reuse)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``colocated:N:ROUTER[:nocache]`` or ``pools:P:T:ROUTER[:nocache][:decode]``."""
        parts = text.split(":")
        flags = set()
        while parts and parts[-1] in ("nocache", "decode"):
            flags.add(parts.pop())
        cache, suffix = "nocache" not in flags, "" if "nocache" not in flags else ", no cache"
        try:
            if parts[0] == "colocated" and len(parts) == 3 and "decode" not in flags:
                n, router = int(parts[1]), parts[2]
                return cls(f"{n} colocated, {router}{suffix}", 0, n, router, cache)
            if parts[0] == "pools" and len(parts) == 4:
                p, t, router = int(parts[1]), int(parts[2]), parts[3]
                decode = "decode" in flags
                return cls(f"{p}P+{t}T, {router}{suffix}"
                           + (", decode-side reuse" if decode else ""), p, t, router, cache,
                           decode)
        except (ValueError, IndexError):
            pass
        raise ValueError(f"bad layout {text!r}: colocated:N:ROUTER[:nocache] or "
                         "pools:P:T:ROUTER[:nocache][:decode]")

    @property
    def prefilling(self) -> int:
        return self.prefill or self.decode


RECIPE = ["colocated:8:round-robin:nocache", "colocated:8:kv", "pools:6:2:jsq", "pools:6:2:kv"]
COLUMNS = {"layout": "layout", "requests": "requests", "ttft_p50_s": "TTFT p50 s",
           "ttft_p99_s": "TTFT p99 s", "itl_p99_ms": "ITL p99 ms", "e2e_p50_s": "E2E p50 s",
           "e2e_p99_s": "E2E p99 s", "prefill_tokens": "prefill tokens computed",
           "hit_rate": "hit rate", "ideal_hit_rate": "ideal", "hit_vs_ideal": "of ideal",
           "p_to_t_gb": "P->T GB (x kv_scale)", "p_to_t_saved_gb": "P->T saved GB"}
PREDICTED = {"layout": "layout", "hit_rate": "hit rate", "dispatch_ms": "dispatch ms",
             "ttft_p50_s": "TTFT p50 s",
             "sim_ttft_p50_s": "simulated", "sim_vs_measured_p50": "sim / measured",
             "ttft_p99_s": "TTFT p99 s", "sim_ttft_p99_s": "simulated p99"}


@dataclass
class Result:
    layout: str
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_ms: float
    e2e_p50_s: float
    e2e_p99_s: float
    prompt_tokens: int
    prefill_tokens: int  # computed: prompt tokens less those reused
    hit_rate: float
    ideal_hit_rate: float
    hit_vs_ideal: float
    p_to_t_gb: float  # KV bytes the P-nodes streamed (the emulated model's: x kv_scale)
    unfinished: int
    p_to_t_saved_gb: float = 0.0  # not streamed: the T-nodes held it (decode-side reuse)
    dispatch_ms: float = 0.0  # disaggregated, measured: the simulator's ``dispatch_s``
    sim_ttft_p50_s: float = math.nan  # the simulator's, at the measured hit rate
    sim_ttft_p99_s: float = math.nan
    sim_vs_measured_p50: float = math.nan

    def simulate(self, layout: Layout, jobs, args) -> Result:
        """With the simulator's TTFT for ``layout`` at this row's hit rate."""
        self.sim_ttft_p50_s, self.sim_ttft_p99_s = simulated_ttft(
            layout, jobs, self.hit_rate, self.dispatch_ms / 1e3 if layout.prefill else 0.0,
            args)
        self.sim_vs_measured_p50 = self.sim_ttft_p50_s / self.ttft_p50_s
        return self


def simulated_ttft(layout: Layout, jobs, hit_rate: float, dispatch_s: float, args
                   ) -> tuple[float, float]:
    """TTFT p50, p99 the simulator gives ``layout`` on ``jobs`` with prefix caches that hold
    ``hit_rate`` of every prompt and, disaggregated, ``dispatch_s`` (profile time)."""
    from orchestrator.planner.simulator import ServingSimulator
    from orchestrator.planner.workload import Request
    from orchestrator.profiles.profile import load_profile

    requests = [Request(i, j.arrival, len(j.prompt_ids), j.max_tokens)
                for i, j in enumerate(jobs)]
    sim = ServingSimulator(load_profile(args.profile), args.batch, layout.prefill,
                           layout.decode, 1, hit_rate=hit_rate, dispatch_s=dispatch_s)
    ttft = [t.first_token - t.request.arrival for t in sim.run(requests)]
    return statistics.median(ttft), percentile(ttft, 99)


def predict_from(path: Path, layouts: list[Layout], jobs, args) -> list[Result]:
    """The rows of an earlier run's ``kv_reuse.csv`` for ``layouts``, with the simulator's
    TTFT at each one's measured hit rate."""
    import csv

    with path.open() as f:
        rows = {row["layout"]: row for row in csv.DictReader(f)}
    results = []
    for layout in layouts:
        if layout.name not in rows:
            raise ValueError(f"{path} has no row {layout.name!r}")
        row = rows[layout.name]
        measured = {f.name: (int if f.type == "int" else float)(row[f.name])
                    for f in dataclasses.fields(Result)
                    if f.name != "layout" and not f.name.startswith("sim_")
                    and f.name in row}  # a column newer than the CSV keeps its default
        results.append(Result(layout.name, **measured).simulate(layout, jobs, args))
    return results


def latencies(times: list[list[float]]) -> dict[str, float]:
    """TTFT, ITL and end-to-end figures of each request's [send, token, ...] times."""
    ttft = [t[1] - t[0] for t in times if len(t) > 1]
    gaps = [b - a for t in times for a, b in zip(t[1:], t[2:], strict=False)]
    e2e = [t[-1] - t[0] for t in times if len(t) > 1]
    nan = math.nan
    return {"ttft_p50_s": statistics.median(ttft) if ttft else nan,
            "ttft_p99_s": percentile(ttft, 99) if ttft else nan,
            "itl_p99_ms": percentile(gaps, 99) * 1e3 if gaps else nan,
            "e2e_p50_s": statistics.median(e2e) if e2e else nan,
            "e2e_p99_s": percentile(e2e, 99) if e2e else nan}


def node_sum(nodes, name: str, **labels: str) -> float:
    return sum(metric(f"127.0.0.1:{n.server.metrics_port}", name, **labels) for n in nodes)


def dispatch_ms(cluster) -> float:
    """A disaggregated request's mean time on the hops to its first token outside the
    P-node's queue and prefill: the frontends' T-node admissions and P-node calls, less
    the P-nodes' queue and execute times (Triton's counters, microseconds)."""
    frontends = [f"127.0.0.1:{s.metrics_port}" for s in cluster.frontends]
    calls = sum(metric(f, "dejavu_legs", what="prefill_call") for f in frontends)
    if not calls:
        return 0.0
    waited = sum(metric(f, "dejavu_leg_seconds", what=what) for f in frontends
                 for what in ("admission", "prefill_call"))
    p_nodes = [f"127.0.0.1:{n.server.metrics_port}" for n in cluster.role("prefill")]
    served_us = sum(metric(p, name, model="prefill") for p in p_nodes
                    for name in ("nv_inference_queue_duration_us",
                                 "nv_inference_compute_infer_duration_us"))
    return (waited - served_us / 1e6) / calls * 1e3


def run_layout(layout: Layout, model_dir: Path, jobs, prompts_hashes, lengths, args,
               run_dir: Path, progress=None) -> Result:
    from clients.disagg import replay, wait_idle
    from orchestrator.cluster.launcher import Cluster
    from orchestrator.control.auth import load_secret
    from orchestrator.fault import ReplicateMode
    from orchestrator.planner.mooncake import ideal_hit_rate

    capacity_mb = args.cache_tokens * KV_BYTES_PER_TOKEN / 2**20
    cache_mb = capacity_mb if layout.cache else 0.0
    with Cluster.up(model_dir, args.start_timeout, run_dir=run_dir, prefill=layout.prefill,
                    decode=layout.decode, colocated=not layout.prefill, profile=args.profile,
                    time_scale=args.time_scale, max_batch=args.batch,
                    max_seq_len=args.max_prompt + args.max_new,
                    replicate=ReplicateMode.OFF, prefix_cache_mb=cache_mb,
                    decode_cache_mb=(args.decode_cache_tokens * KV_BYTES_PER_TOKEN / 2**20
                                     if layout.decode_cache else 0.0),
                    kv_block=args.kv_block, router=layout.router,
                    kv_weight=args.kv_weight) as cluster:
        prefilling = cluster.role("prefill") or cluster.role("decode")
        times = replay(cluster.frontend.grpc_url, load_secret(cluster.secret_file), jobs,
                       progress, args.time_scale, args.drain)
        wait_idle(cluster)
        hit = node_sum(prefilling, "dejavu_prefix_cache", what="hit_tokens") if cache_mb else 0
        streamed = node_sum(cluster.role("prefill"), "dejavu_kv_bytes")
        saved = node_sum(cluster.role("decode"), "dejavu_kv_reused_bytes")
        dispatch = dispatch_ms(cluster) / args.time_scale if layout.prefill else 0.0
    blocks = int(cache_mb * 2**20 // (args.kv_block * KV_BYTES_PER_TOKEN)) * layout.prefilling
    ideal = ideal_hit_rate(prompts_hashes, lengths, blocks, args.kv_block) if blocks else 0.0
    total = sum(lengths)
    return Result(layout.name, len(jobs), **latencies(times), prompt_tokens=total,
                  prefill_tokens=int(total - hit), hit_rate=hit / total, ideal_hit_rate=ideal,
                  hit_vs_ideal=hit / total / ideal if ideal else math.nan,
                  p_to_t_gb=streamed / 1e9, p_to_t_saved_gb=saved / 1e9, dispatch_ms=dispatch,
                  unfinished=sum(len(t) - 1 < j.max_tokens for j, t in zip(jobs, times,
                                                                            strict=True))
                  ).simulate(layout, jobs, args)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clients.provenance import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r.layout for r in results]
    left.bar(names, [r.ttft_p50_s for r in results], label="p50")
    left.bar(names, [r.ttft_p99_s - r.ttft_p50_s for r in results],
             bottom=[r.ttft_p50_s for r in results], alpha=0.4, label="p99")
    left.set_ylabel("TTFT (s, profile time)")
    left.legend()
    right.bar(names, [r.hit_rate for r in results], label="measured")
    right.scatter(names, [r.ideal_hit_rate for r in results], color="k", zorder=3,
                  label="offline ideal, same capacity")
    right.set_ylabel("prompt tokens reused")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("Mooncake conversation trace, emulated H100 Llama-2-70B machines")
    fig.tight_layout()
    save_figure(fig, path, 150)


def dummy_long_model(folder: Path, positions: int) -> Path:
    """The dummy Llama for long prompts: 32 bytes of KV per token, ``positions`` long."""
    from orchestrator.engine.checkpoint import make_checkpoint

    folder = folder / f"llama-kv32-{positions}"
    if (folder / "config.json").is_file():
        return folder
    return make_checkpoint("llama", "tiny", folder, num_hidden_layers=2, hidden_size=8,
                           num_attention_heads=4, num_key_value_heads=1, intermediate_size=16,
                           max_position_embeddings=positions)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench disagg --trace mooncake",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trace", choices=["mooncake"], default="mooncake")
    parser.add_argument("--trace-file", type=Path,
                        help="the trace (JSON lines, or .gz); default: the shipped first 20 "
                        "minutes of the conversation trace")
    parser.add_argument("--start", type=float, default=0.0, help="trace seconds to skip")
    parser.add_argument("--window", type=float, default=600.0, help="trace seconds to replay")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="arrivals this many times as dense as the trace's")
    parser.add_argument("--layouts", nargs="+", default=RECIPE,
                        help="colocated:N:ROUTER[:nocache] or pools:P:T:ROUTER[:nocache]"
                        "[:decode] (ROUTER: jsq, kv, round-robin; decode: the T-nodes keep "
                        "finished requests' KV, --decode-cache-tokens each: decode-side "
                        "reuse); default: Dynamo's recipe")
    parser.add_argument("--profile", default="splitwise-llama2-70b-h100")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="K")
    parser.add_argument("--batch", type=int, default=16, help="sequences per T-node microbatch")
    parser.add_argument("--max-prompt", type=int, default=32768,
                        help="longer prompts are cut here (the trace's reach 126K)")
    parser.add_argument("--max-new", type=int, default=512,
                        help="longer outputs are cut here")
    parser.add_argument("--kv-block", type=int, default=64,
                        help="prefix-cache block, tokens (divides the trace's 512)")
    parser.add_argument("--kv-weight", type=float, default=NodeConfig.kv_weight,
                        help="the KV router's weight of a prompt's tokens to compute against "
                        "a node's pending tokens")
    parser.add_argument("--cache-tokens", type=int, default=0,
                        help="each prefilling node's cache, tokens (default: half the "
                        "profile machine's KV memory)")
    parser.add_argument("--decode-cache-tokens", type=int, default=0,
                        help="each T-node's cache of finished requests, tokens (layouts with "
                        ":decode; default: --cache-tokens)")
    parser.add_argument("--drain", type=float, default=math.inf,
                        help="cancel what still runs this long after the last arrival")
    parser.add_argument("--predict-from", type=Path, metavar="CSV",
                        help="no run: the simulator's TTFT at the hit rates of this earlier "
                        "kv_reuse.csv, beside its measured TTFT")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/kv_reuse"))
    args = parser.parse_args(argv)
    from orchestrator.cluster.tritonserver import ServerError
    from orchestrator.engine.emulated import load_emulated_engine
    from orchestrator.kv.prefix_cache import block_hashes
    from orchestrator.planner import mooncake
    from orchestrator.profiles.profile import load_profile

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        layouts = [Layout.parse(text) for text in args.layouts]
        if mooncake.TRACE_BLOCK_TOKENS % args.kv_block:
            raise ValueError(f"--kv-block {args.kv_block} does not divide the trace's "
                             f"{mooncake.TRACE_BLOCK_TOKENS}-token blocks")
        profile = load_profile(args.profile)
        args.cache_tokens = args.cache_tokens or profile.max_kv_tokens() // 2
        args.decode_cache_tokens = args.decode_cache_tokens or args.cache_tokens
        model_dir = dummy_long_model(args.out, args.max_prompt + args.max_new)
        engine = load_emulated_engine(str(model_dir), profile, max_seq_len=1)
        requests = mooncake.load_mooncake(args.trace_file, args.start, args.window,
                                          args.rate_scale)
        blocks = mooncake.BlockTokens(engine.vocab_size)
        from clients.disagg import Job

        prompts = [mooncake.prompt_tokens(r, blocks, args.max_prompt) for r in requests]
        jobs = [Job(p, min(args.max_new, max(1, r.output_len)), r.arrival_s)
                for p, r in zip(prompts, requests, strict=True)]
        hashes = [block_hashes(p, args.kv_block) for p in prompts]
        lengths = [len(p) for p in prompts]
        print(f"{len(jobs)} requests over {requests[-1].arrival_s:.0f} s of the trace (rate "
              f"x{args.rate_scale:g}): prompts mean {statistics.mean(lengths):,.0f} tokens "
              f"(cut at {args.max_prompt}), outputs mean "
              f"{statistics.mean(j.max_tokens for j in jobs):.0f}; each prefilling node's "
              f"cache {args.cache_tokens:,} tokens in {args.kv_block}-token blocks; KV "
              f"{engine.kv_scale:.3g}x the profile's per token (kv_scale)", flush=True)
        if args.predict_from:
            results = predict_from(args.predict_from, layouts, jobs, args)
            write_csv(args.out / "kv_reuse_predicted.csv", results)
            print(markdown(results, PREDICTED))
            print(f"wrote {args.out}/kv_reuse_predicted.csv")
            return 0
        results = []
        for layout in layouts:
            print(f"{layout.name}...", flush=True)
            results.append(run_layout(layout, model_dir, jobs, hashes, lengths, args,
                                      args.out / "cluster"))
            write_csv(args.out / "kv_reuse.csv", results)
    except (ServerError, RuntimeError, ValueError, OSError) as exc:
        print(f"dejavu bench disagg --trace mooncake: {exc}", file=sys.stderr)
        return 1
    plot(results, args.out / "kv_reuse.png")
    print(markdown(results, COLUMNS))
    print(markdown(results, PREDICTED))
    print(f"profile {args.profile}, time scale K = {args.time_scale:g} (times in profile "
          f"time); KV {engine.kv_scale:.3g}x the profile's per token (P->T bytes are the "
          f"emulated model's: / kv_scale for the real model's)")
    print(f"wrote {args.out}/kv_reuse.csv, kv_reuse.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
