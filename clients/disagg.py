"""``dejavu bench disagg``: disaggregated against colocated serving on real tritonservers,
at equal devices, replaying a Splitwise trace with Poisson arrivals.

The device budget is a list of core sets, one per "machine" (default: each core
of this host). Colocated: one T-node per machine, each prefilling its own
prompts (data parallel, Splitwise's baseline). Colocated pipeline: one token
pipeline with a stage on every machine, its prompts running in its microbatch
steps stage by stage (DejaVu's baseline: pipeline parallel with the bubbles
prompts make). Disaggregated: the planner's split of the same machines into P-nodes
and token pipelines (1P+1T on two machines; on three, unless the planner picks
otherwise, a P-node feeding a depth-2 token pipeline: DejaVu's comparison with the
colocated pipeline at equal depth). Every node is pinned to its machine's cores; the
frontend (router, the clients' end) is not. Both modes serve the same requests:
prompt and output lengths from the Azure trace scaled to the model's context,
random prompt tokens (seeded), sent to the frontend's orchestrator model over
gRPC streaming at each arrival rate.

Per mode and rate: sustained throughput (below), TTFT p50/p99, time
between tokens (TBT) p50/p99 over every gap of every request (a response that
carries n tokens, of a stream that fell behind, spreads its gap over them), the
TBT p99 of running requests (gaps from the second token on: a disaggregated request's
first gap also holds its wait for a slot in a T-node's batch, the others
are decode steps, and prompts that interrupt them), and goodput: the
requests/s that met the SLO (TTFT <= ``ttft_slo`` x the unloaded prefill of
its prompt, its mean TBT <= ``tbt_slo`` x the unloaded token step; unloaded =
the bare engine on one machine's cores), next to the requests/s the planner's capacity
model and the serving simulator predict at saturation for that layout, from one engine
profile (the emulated engine's, or the torch engine measured on one machine over the
workload's lengths and the cluster's batch). Output: ``disagg.csv``,
``disagg.png``, a table, and every request's times per mode and rate
(``times-<mode>-<rate>.json``).

Sustained throughput (:mod:`orchestrator.planner.throughput`, the one definition the
serving simulator measures itself by too): the run's saturated middle, not its edges.
tokens/s counts the tokens whose arrival lies between the 10th and 90th percentile of
all token arrival times, over that span; completions/s (``req/s``) the requests that
finished between the 10th and 90th percentile of completion times, over
that span; goodput those of them that met the SLO. ``tok req/s`` is tokens/s over the
mean output length of the requests sent: the requests/s those tokens make at the
workload's mean lengths, the planner's unit, set beside its prediction: the planner's
capacity model at the same requests' lengths, and the simulator replaying the same
requests (arrivals, lengths, drain) measured the same way. ``--drain S``
cancels what still runs S seconds after the last arrival, so a few long outputs do not
hold the run for minutes (their tokens past the 90th percentile would not count anyway).

``--time-scale K`` (emulated engine): every node sleeps the profile's times x K and the
arrivals come K times slower, so the serving path's own CPU stays small against the
engine's time; every reported time is divided by K and every rate multiplied by K
(profile time), and K is printed with every figure.

CPU: every process group of the cluster (tritonservers, their Python stubs, the
frontend, the controller, the supervisor, the OpenAI API) is read from /proc before and
after each rate: its CPU seconds over the tokens it served is the serving path's own CPU
per token (the engine's sleep costs none). The host's busy cores (/proc/stat, everyone's)
and 1-minute load average are sampled beside it; a rate is flagged CPU-bound when the
cluster alone used more than half the cores or the host more than 80% of them
(:attr:`clients.common.CpuUse.cpu_bound`). The torch engine computes on those same
cores: ``--serving-cpu-ms SIGMA`` (or ``auto``: measured first with the emulated engine
sleeping the torch profile, the same requests on the colocated layout) has the
predictions count the serving path's share of them (:func:`on_shared_host`). With a
profile that states them, cost and
energy per request are the layout's machines x the profile's cost per hour and power,
over ``tok req/s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clients.common import (
    CpuMeter,
    CpuUse,
    dummy_model,
    markdown,
    metric,
    model_arguments,
    on_machine,
    write_csv,
)
from clients.provenance import save_figure
from orchestrator.cluster.devices import Devices
from orchestrator.planner.budget import cost_per_request, fleet, fleet_total
from orchestrator.planner.throughput import percentile, rate_between, sustained_rps

if TYPE_CHECKING:
    from orchestrator.planner.planner import Layout

MODES = ("colocated", "colocated-chunked", "colocated-pipeline", "disaggregated")
CHUNKED = "colocated-chunk"  # + the budget: one run mode per --prefill-chunks entry


def run_modes(modes: list[str], chunks: list[int]) -> list[str]:
    """``modes`` as the bench runs them: ``colocated-chunked`` once per step budget
    (``colocated-chunk512``, ...)."""
    return [m for mode in modes
            for m in ([f"{CHUNKED}{n}" for n in chunks] if mode == "colocated-chunked"
                      else [mode])]


def prefill_chunk_of(mode: str) -> int:
    """The step budget of a run mode (0: whole prompts)."""
    return int(mode.removeprefix(CHUNKED)) if mode.startswith(CHUNKED) else 0


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float  # seconds from the start of the run


@dataclass
class Point:
    """One mode at one rate; times and rates in profile time (measured / K, x K)."""

    mode: str
    layout: str
    rate_rps: float  # offered
    requests: int
    tokens_per_s: float  # sustained (:func:`sustained`)
    requests_per_s: float  # completions/s, sustained
    token_rps: float  # tokens_per_s over the mean output length sent
    unfinished: float  # fraction of the requests cancelled at the drain's end
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_ms: float
    tbt_p99_ms: float
    tbt_p99_running_ms: float  # gaps from the second token on
    slo_met: float  # fraction of requests
    goodput_rps: float
    predicted_rps: float  # the planner's, for this layout
    simulated_rps: float = math.nan  # the serving simulator's, at saturation
    time_scale: float = 1.0  # K: the engine slept the profile's times x K
    cpu_ms_per_token: float = math.nan  # the cluster's CPU over the tokens it served
    cluster_cpu_cores: float = math.nan  # its CPU seconds per wall second
    host_busy_cores: float = math.nan  # every process on the host
    load_avg: float = math.nan  # 1-minute, mean over the rate's run
    cpu_bound: bool = False  # CpuUse.cpu_bound
    cost_per_request: float = math.nan  # the profile's cost unit
    energy_per_request_kj: float = math.nan  # at the profile's power

    def with_cpu(self, use: CpuUse, tokens: int) -> Point:
        """This point with the CPU ``use`` of its run, which served ``tokens``."""
        from dataclasses import replace

        return replace(self, cpu_ms_per_token=use.cluster_cpu_s / max(1, tokens) * 1e3,
                       cluster_cpu_cores=use.cluster_cores,
                       host_busy_cores=use.host_busy_cores, load_avg=use.load_avg,
                       cpu_bound=use.cpu_bound)


def scaled_requests(trace: str, count: int, seed: int, prompt_scale: float,
                    output_scale: float, max_prompt: int, max_new: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of ``count`` trace requests, scaled and clipped."""
    from orchestrator.planner import workload as wl

    picked = wl.sample(wl.load_trace(trace), count, seed)
    return [(min(max_prompt, max(8, round(r.prompt_len * prompt_scale))),
             min(max_new, max(2, round(r.output_len * output_scale)))) for r in picked]


def make_jobs(lengths: list[tuple[int, int]], rate: float, vocab: int, seed: int) -> list[Job]:
    from orchestrator.planner import workload as wl

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(p)] for p, _ in lengths]
    arrivals = wl.poisson([wl.Request(i, 0.0, p, n) for i, (p, n) in enumerate(lengths)],
                          rate, seed)
    return [Job(ids, n, a.arrival) for ids, (_, n), a in zip(prompts, lengths, arrivals,
                                                            strict=True)]


def requests_of(jobs: list[Job]):
    """The planner's view of ``jobs``: arrival, prompt and output lengths."""
    from orchestrator.planner.workload import Request

    return [Request(i, j.arrival, len(j.prompt_ids), j.max_tokens) for i, j in enumerate(jobs)]


def replay(url: str, secret: bytes, jobs: list[Job], progress=None, time_scale: float = 1.0,
           drain_s: float = math.inf) -> list[list[float]]:
    """Send each job at its arrival time x ``time_scale``; each one's [send, token, token,
    ...] times from the start, divided by ``time_scale`` (profile time). What still runs
    ``drain_s`` (profile time) after the last arrival is cancelled, its times cut there.

    One event loop and one gRPC channel carry every stream: a client (channel and
    threads) per request made thousands of threads at saturation, 2,812 requests drove
    the host's load past 300 and the run was the client's, not the cluster's."""
    return asyncio.run(_replay(url, secret, jobs, progress, time_scale, drain_s))


async def _replay(url: str, secret: bytes, jobs: list[Job], progress, time_scale: float,
                  drain_s: float) -> list[list[float]]:
    import tritonclient.grpc.aio as grpcclient

    from clients.breakdown import signed_request
    from orchestrator.serving.params import GenerationParams

    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()
    stop_at = (math.inf if math.isinf(drain_s) else
               start + (max(j.arrival for j in jobs) + drain_s) * time_scale)

    async def run(job: Job) -> list[float]:
        await asyncio.sleep(max(0.0, start + job.arrival * time_scale - time.perf_counter()))
        request = signed_request(secret, job.prompt_ids,
                                 GenerationParams(max_tokens=job.max_tokens, stream=True))
        times = token_times(await stream_arrivals(client, request, stop_at))
        if len(times) - 1 > job.max_tokens or (len(times) - 1 < job.max_tokens
                                               and math.isinf(stop_at)):
            raise RuntimeError(f"a request streamed {len(times) - 1} tokens, "
                               f"not {job.max_tokens}")
        if progress is not None:
            progress()
        return [(t - start) / time_scale for t in times]

    try:
        return list(await asyncio.gather(*(run(job) for job in jobs)))
    finally:
        await client.close()


async def stream_arrivals(client, request: dict, stop_at: float = math.inf,
                          timeout_s: float = 600.0) -> list[tuple[float, int]]:
    """When the responses of one request to the frontend's ``orchestrator`` model that
    carry tokens arrive, and how many each holds, [(send time, 0), ...] (``perf_counter``);
    cancelled at ``stop_at`` if still running (the frontend then frees its slots). The
    stream sends one request and closes its side, so it ends when the request has."""
    async def one_request():
        yield {"model_name": "orchestrator", **request}

    responses = client.stream_infer(one_request())
    arrivals = [(time.perf_counter(), 0)]
    while (left := stop_at - time.perf_counter()) > 0:
        try:
            result, error = await asyncio.wait_for(anext(responses), min(timeout_s, left))
        except StopAsyncIteration:
            return arrivals
        except TimeoutError:
            if time.perf_counter() < stop_at:
                responses.cancel()
                raise RuntimeError(f"no response in {timeout_s:.0f} s") from None
            break
        if error is not None:
            responses.cancel()
            raise RuntimeError(f"orchestrator: {error}")
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            arrivals.append((time.perf_counter(), ids.size))
    responses.cancel()
    return arrivals


def sustained(jobs: list[Job], times: list[list[float]], met: list[bool]
              ) -> tuple[float, float, float]:
    """(tokens/s, completions/s, goodput req/s) of the run's middle (:func:`rate_between`);
    ``met``: whether each request met the SLO. A cancelled request did not complete."""
    tokens = [t for ts in times for t in ts[1:]]
    done = [ts[-1] for job, ts in zip(jobs, times, strict=True)
            if len(ts) - 1 == job.max_tokens]
    completions = rate_between(done)
    if math.isnan(completions):
        return rate_between(tokens), completions, math.nan
    a, b = percentile(done, 10), percentile(done, 90)
    good = sum(ok and a <= ts[-1] <= b for job, ts, ok in zip(jobs, times, met, strict=True)
               if len(ts) - 1 == job.max_tokens)
    return rate_between(tokens), completions, good / (b - a)


def save_times(path: Path, layout: str, jobs: list[Job], times: list[list[float]]) -> None:
    """Each request's (prompt tokens, tokens asked, [send, token, ...] in profile time): its
    SLOs can be judged afterwards under any bounds (DistServe's, Splitwise's)."""
    rows = [[len(j.prompt_ids), j.max_tokens, t] for j, t in zip(jobs, times, strict=True)]
    path.write_text(json.dumps({"layout": layout, "requests": rows}) + "\n")


def token_times(arrivals: list[tuple[float, int]]) -> list[float]:
    """[send, token, token, ...]: a response of n tokens (a stream that fell behind) spreads
    its gap since the one before evenly over its tokens."""
    times = [arrivals[0][0]]
    for at, n in arrivals[1:]:
        times += [times[-1] + (at - times[-1]) * (i + 1) / n for i in range(n)]
    return times


def summarize(mode: str, layout: str, rate: float, jobs: list[Job], times: list[list[float]],
              unloaded_prompt_s_per_token: float, unloaded_step_s: float, ttft_slo: float,
              tbt_slo: float, predicted_rps: float, time_scale: float = 1.0) -> Point:
    """``times``: each job's [send, token, ...] in profile time (:func:`replay`'s); TTFT
    over the requests that got a first token, SLO met by those that also finished."""
    ttft = [t[1] - t[0] for t in times if len(t) > 1]
    gaps = [b - a for t in times for a, b in zip(t[1:], t[2:], strict=False)]
    running = [b - a for t in times for a, b in zip(t[2:], t[3:], strict=False)]
    met = []
    for job, t in zip(jobs, times, strict=True):
        mean_tbt = (t[-1] - t[1]) / max(1, len(t) - 2) if len(t) > 1 else math.inf
        met.append(len(t) - 1 == job.max_tokens
                   and t[1] - t[0] <= ttft_slo * unloaded_prompt_s_per_token * len(job.prompt_ids)
                   and mean_tbt <= tbt_slo * unloaded_step_s)
    tokens_per_s, done_per_s, goodput = sustained(jobs, times, met)
    return Point(
        mode=mode, layout=layout, rate_rps=rate, requests=len(times),
        tokens_per_s=tokens_per_s, requests_per_s=done_per_s,
        token_rps=sustained_rps(times, [j.max_tokens for j in jobs]),
        unfinished=sum(len(t) - 1 < j.max_tokens for j, t in zip(jobs, times, strict=True))
        / len(times),
        ttft_p50_s=statistics.median(ttft) if ttft else math.nan,
        ttft_p99_s=percentile(ttft, 99) if ttft else math.nan,
        tbt_p50_ms=statistics.median(gaps) * 1e3 if gaps else math.nan,
        tbt_p99_ms=percentile(gaps, 99) * 1e3 if gaps else math.nan,
        tbt_p99_running_ms=percentile(running, 99) * 1e3 if running else math.nan,
        slo_met=sum(met) / len(times), goodput_rps=goodput, predicted_rps=predicted_rps,
        time_scale=time_scale,
    )


@dataclass(frozen=True)
class Pools:
    """Splitwise's disaggregated layout: a pool of P-nodes and one of T-nodes, one machine
    each, any request's prompt on any P-node and its tokens on any T-node."""

    prefill: int
    decode: int
    machines: tuple[str, str] | None = None  # (P-nodes', T-nodes') where they differ

    def __str__(self) -> str:
        if self.machines:  # Splitwise's mixed pools, e.g. "2P dgx-h100 + 12T dgx-a100"
            return f"{self.prefill}P {self.machines[0]} + {self.decode}T {self.machines[1]}"
        return f"{self.prefill}P+{self.decode}T pools"


def cluster_for(mode: str, model_dir: Path, machines: list, run_dir: Path, batch: int,
                max_seq_len: int, split, profile: str = "", time_scale: float = 1.0,
                timeout_s: float = 180.0, prefill_profile: str = "", depth: int = 0):
    """The cluster of ``mode`` on ``machines`` (core sets): colocated one T-node each (a
    ``colocated-chunkN`` mode: prompts in chunks, N tokens a step), or
    one stage each of pipelines ``depth`` deep (0: one pipeline over them all);
    disaggregated the planner's ``split`` (a
    :class:`~orchestrator.planner.planner.Layout`): its P-nodes, each on its D_p machines,
    and its token pipelines, a stage per machine. No mode replicates its KV. ``profile``:
    every node runs the emulated engine on it (empty: the torch engine), its times x
    ``time_scale``; ``prefill_profile``: the P-nodes' own (mixed machines)."""
    from orchestrator.cluster.launcher import Cluster, spread_devices
    from orchestrator.cluster.topology import decode_name
    from orchestrator.fault import ReplicateMode

    if mode == "colocated" or mode.startswith(CHUNKED):
        devices = {f"decode{i}": m for i, m in enumerate(machines)}
        kwargs = dict(prefill=0, decode=len(machines), colocated=True,
                      prefill_chunk=prefill_chunk_of(mode))
    elif mode == "colocated-pipeline":
        depth = depth or len(machines)
        devices = {decode_name(i // depth, i % depth, depth): m for i, m in enumerate(machines)}
        kwargs = dict(prefill=0, decode=len(machines) // depth, decode_depth=depth,
                      colocated=True)
    elif isinstance(split, Pools):
        names = [f"prefill{i}" for i in range(split.prefill)] + [
            decode_name(j, 0, 1) for j in range(split.decode)]
        devices = dict(zip(names, machines, strict=True))
        kwargs = dict(prefill=split.prefill, decode=split.decode)
    else:
        spec = {"prefill": {"pipelines": split.replicas, "depth": split.prompt_depth},
                "decode": {"pipelines": split.replicas, "depth": split.token_depth}}
        devices = {name: Devices.parse(d) for name, d in spread_devices(spec, machines).items()}
        kwargs = dict(prefill=split.replicas, prefill_depth=split.prompt_depth,
                      decode=split.replicas, decode_depth=split.token_depth)
    return Cluster.up(model_dir, timeout_s, run_dir=run_dir / mode, max_batch=batch,
                      max_seq_len=max_seq_len, devices=devices,
                      replicate=ReplicateMode.OFF, profile=profile,
                      **({"time_scale": time_scale} if profile else {}),
                      **({"prefill_profile": prefill_profile} if kwargs.get("prefill") else {}),
                      **kwargs)


def cluster_groups(cluster) -> set[int]:
    """Every process group the cluster started (each in a session of its own): the
    tritonservers with their Python stubs, the controller, the OpenAI API, the supervisor
    and its watchdog."""
    processes = [n.server.process for n in cluster.nodes]
    processes += [cluster.controller.process, cluster.supervisor, cluster.watchdog,
                  cluster.openai.process if cluster.openai else None]
    return {p.pid for p in processes if p is not None}


def wait_idle(cluster, timeout_s: float = 120.0) -> None:
    """Until no node holds a request (cancelled ones freed), so a rate starts empty."""
    deadline = time.monotonic() + timeout_s
    while any(metric(f"127.0.0.1:{n.server.metrics_port}", "dejavu_queue_length") > 0
              for n in cluster.nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster still holds requests after {timeout_s:g} s")
        time.sleep(0.2)


def per_request(point: Point, fleet: list[str]) -> Point:
    """``point`` with its cost and energy per request, where the profiles state their
    machine's cost per hour and power: the ``fleet`` (one profile per machine in use)
    over its ``token_rps``."""
    from dataclasses import replace

    from orchestrator.profiles.profile import load_profile

    if not all(fleet) or not point.token_rps > 0:
        return point
    machines = [load_profile(name).machine for name in fleet]
    cost = cost_per_request(fleet_total(m.cost_per_hour for m in machines), point.token_rps)
    energy = fleet_total(m.power_w for m in machines) / point.token_rps / 1e3
    return replace(point, cost_per_request=cost, energy_per_request_kj=energy)


def engine_profile_of(model_dir: Path, lengths: list[tuple[int, int]], batch: int,
                      machine: Devices, engine_profile: str = ""):
    """The engine profile the predictions read, with DejaVu's m (a prefill streaming its KV
    layer by layer over NIXL to another process, over a plain one): ``engine_profile``'s
    and m = 1 (the emulated engine sleeps the profile's prefill whatever it sends), else the
    torch engine measured on one ``machine`` over a grid that spans the workload (prompts,
    batch 1 to ``batch``, contexts), and its m at the mean prompt."""
    from orchestrator.engine.config import ModelConfig
    from orchestrator.engine.measure import measure_profile
    from orchestrator.engine.torch_engine import load_engine
    from orchestrator.planner.perf_model import Workload, measure_timings
    from orchestrator.profiles.profile import load_profile

    if engine_profile:
        return load_profile(engine_profile), 1.0
    longest = max(p + n for p, n in lengths)
    # Prefill up to a batch of the longest prompts (a colocated step prefills them together)
    positions = ModelConfig.from_dir(model_dir).max_positions
    most = min(positions - 4, batch * max(p for p, _ in lengths))
    prompts = sorted({min(most, x) for x in (8, 32, 128, 512, most)})
    contexts = sorted({min(longest, x) for x in (16, 128, 512)})
    batches = sorted({1, 2, batch} | {b for b in (4, 8, 16) if b < batch})
    device = "cuda" if machine.kind == "cuda" else "cpu"
    with on_machine(machine):
        engine = load_engine(model_dir, stage=None, device=device,
                             max_seq_len=max(most, longest) + 4)
        profile = measure_profile(engine, prompts, batches, contexts, reps=2,
                                  name=f"{model_dir.name}-{machine}")
        prompt = round(statistics.fmean(p for p, _ in lengths))
        return profile, measure_timings(engine, Workload(prompt, 2), reps=5).m


def predictions(model_dir: Path, lengths: list[tuple[int, int]], batch: int,
                machine: Devices, machines: int, engine_profile: str = "",
                split: Layout | None = None, prefill_profile: str = "", depth: int = 0,
                chunks: tuple[int, ...] = ()):
    """The planner on one engine profile (the emulated engine's, or the torch engine
    measured on one ``machine``; the P-nodes' own where ``prefill_profile`` names one) at
    the workload's lengths: its pick, the layout each mode runs (disaggregated: ``split``
    where given, Splitwise's pools or DejaVu's pipelines; the colocated pipelines ``depth``
    deep, 0: one over every machine; the colocated machines with each of ``chunks`` as their
    step budget), the profiles (``cost``, ``prompt_cost``; ``costs``:
    each mode's, the same until :func:`on_shared_host`), each mode's predicted requests/s,
    and the unloaded prefill time per token and step."""
    from orchestrator.engine.config import ModelConfig
    from orchestrator.planner.capacity import Capacity
    from orchestrator.planner.perf_model import (
        Workload,
        profile_from_config,
        timings_from_engine_profile,
    )
    from orchestrator.planner.planner import Layout, plan, predict_rps
    from orchestrator.profiles.profile import load_profile

    cost, m = engine_profile_of(model_dir, lengths, batch, machine, engine_profile)
    prompt_cost = load_profile(prefill_profile) if prefill_profile else None
    prompt = round(statistics.fmean(p for p, _ in lengths))
    new = round(statistics.fmean(n for _, n in lengths))
    workload = Workload(prompt, new, batch)
    profile = profile_from_config(ModelConfig.from_dir(model_dir), workload, 80e9,
                                  *timings_from_engine_profile(cost, workload), m,
                                  source=f"engine profile {cost.name}")
    capacity = Capacity.of(lengths, cost, batch, m, prompt_cost=prompt_cost)
    picked = plan(profile, machines, capacity)
    # The disaggregated mode runs the pick, or the best disaggregated layout when the
    # planner colocates (every candidate's pipelines fit the model's layers).
    best = next(s.layout for s in picked.candidates if not s.layout.colocated)
    chosen = split or (best if picked.layout.colocated else picked.layout)
    mixed = (prompt_cost.machine.name, cost.machine.name) if prompt_cost else None
    split = Pools(chosen.replicas, chosen.token_count, mixed) if chosen.is_pools else chosen
    depth = depth or machines
    layouts = {"colocated": Layout(machines, 1),
               **{f"{CHUNKED}{n}": Layout(machines, 1) for n in chunks},
               "colocated-pipeline": Layout(machines // depth, depth),
               "disaggregated": chosen}
    return {"pick": str(picked.layout), "split": split, "Y/t": picked.ratio,
            "real_split": picked.real_split, "profile": cost.name, "cost": cost, "m": m,
            "prompt_cost": prompt_cost, "layouts": layouts, "costs": dict.fromkeys(layouts, cost),
            "predicted": {mode: predict_rps(capacity, lay) for mode, lay in layouts.items()},
            "tokens_per_request": capacity.demand.output,
            # The SLOs' unloaded times: the P-nodes' machine's where the machines are mixed
            # (Splitwise-HA against all-H100: the same bar for both).
            "prompt_s_per_token": (prompt_cost or cost).prefill_s(prompt) / prompt,
            "step_s": (prompt_cost or cost).decode_s(1, capacity.demand.context),
            "batch_step_s": capacity.decode_s(capacity.slots)}


def on_shared_host(pred: dict, serving_s_per_token: float, cores: int) -> dict:
    """``pred`` (:func:`predictions`) where the torch engines compute on the ``cores`` that
    the serving path, at ``serving_s_per_token`` of CPU a token, shares with them: each
    mode's profile slowed as much as that leaves its engines
    (:func:`~orchestrator.planner.capacity.shared_host_slowdown`), and its rate with it."""
    from orchestrator.planner.capacity import shared_host_slowdown

    slowdown = {mode: shared_host_slowdown(rps, pred["tokens_per_request"],
                                           serving_s_per_token, cores)
                for mode, rps in pred["predicted"].items()}
    return {**pred, "slowdown": slowdown,
            "costs": {mode: pred["cost"].slowed(s) for mode, s in slowdown.items()},
            "predicted": {mode: rps / slowdown[mode] for mode, rps in pred["predicted"].items()}}


def serving_cpu_s(model_dir: Path, cost, machines: list, run_dir: Path, batch: int,
                  max_seq_len: int, jobs: list[Job], timeout_s: float) -> float:
    """The serving path's own CPU seconds per token on this host: ``jobs`` on the colocated
    layout with the emulated engine sleeping the torch engine's profile ``cost``, so that
    what the cluster's processes use is everything but the engines' compute."""
    from orchestrator.control.auth import load_secret

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "torch-profile.json"
    cost.save(path)
    with cluster_for("colocated", model_dir, machines, run_dir / "cluster", batch, max_seq_len,
                     None, str(path), timeout_s=timeout_s) as cluster:
        url, secret = cluster.frontend.grpc_url, load_secret(cluster.secret_file)
        replay(url, secret, jobs[:len(machines)])  # warm every node
        with CpuMeter(cluster_groups(cluster)) as meter:
            times = replay(url, secret, jobs)
        wait_idle(cluster)
    assert meter.use is not None
    return meter.use.cluster_cpu_s / max(1, sum(len(t) - 1 for t in times))


def expected(cost, requests, layout, batch: int, drain_s: float = math.inf,
             prompt_cost=None, m: float = 1.0, prefill_chunk: int = 0) -> tuple[float, float]:
    """What the planner and the simulator expect of ``requests`` on ``layout``: the capacity
    model's requests/s at their lengths, and the serving simulator's sustained rate
    replaying the same requests (arrivals, lengths, the drain's cut), measured as the run
    is. A short run at saturation sits below capacity while it fills; the simulator sees
    that, the planner does not. ``prompt_cost``: the P-nodes' own profile; ``m``: DejaVu's
    streamed-prefill factor; ``prefill_chunk``: colocated, the step budget (the capacity
    model has none: its rate is the whole prompts')."""
    from orchestrator.planner.capacity import Capacity
    from orchestrator.planner.planner import predict_rps
    from orchestrator.planner.search import simulate_serving

    lengths = [(r.prompt_len, r.output_len) for r in requests]
    return (predict_rps(Capacity.of(lengths, cost, batch, m, prompt_cost=prompt_cost), layout),
            simulate_serving(cost, requests, layout, batch, m,
                             cut_at=max(r.arrival for r in requests) + drain_s,
                             prompt_cost=prompt_cost, prefill_chunk=prefill_chunk))


def given_split(pools: list[int] | None, split: list[int] | None, machines: int):
    """The disaggregated layout asked for on the command line (``--pools P T`` or
    ``--split R DP DT``), checked against the machines; None: the planner's."""
    from orchestrator.planner.planner import Layout

    if pools:
        if min(pools) < 1 or sum(pools) != machines:
            raise ValueError(f"--pools must split the {machines} machines, both >= 1")
        return Layout.pools(*pools)
    if split:
        layout = Layout(*split)
        if min(split) < 1 or layout.machines != machines:
            raise ValueError(f"--split R DP DT needs R x (DP + DT) = {machines} machines, "
                             f"each >= 1; got {layout.machines}")
        return layout
    return None


def check_depths(modes: list[str], split, depth: int, layers: int) -> None:
    """A pipeline needs a layer per stage: refuse a mode deeper than the model, before any
    cluster starts (the planner's split of 8 machines over a 4-layer tiny model)."""
    depths = {"colocated-pipeline": depth}
    if not isinstance(split, Pools):
        depths["disaggregated"] = max(split.prompt_depth, split.token_depth)
    deep = {m: d for m, d in depths.items() if m in modes and d > layers}
    if deep:
        raise ValueError(", ".join(f"{m} needs {d} stages" for m, d in deep.items())
                         + f", the model has {layers} layers: choose --modes, --depth, "
                         "--pools or --split")


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("ttft_p99_s", "TTFT p99 (s)"), ("tokens_per_s", "sustained throughput (tok/s)"),
              ("tbt_p99_ms", "TBT p99 (ms)"), ("tbt_p99_running_ms",
                                                "TBT p99 from the 2nd token (ms)")]
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for mode in dict.fromkeys(p.mode for p in points):
            mine = [p for p in points if p.mode == mode]
            if mine:
                ax.plot([p.rate_rps for p in mine], [getattr(p, key) for p in mine], "o-",
                        label=f"{mode} ({mine[0].layout})")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    k = points[0].time_scale if points else 1.0
    fig.suptitle("disaggregated vs colocated (data and pipeline parallel) at equal devices"
                 + (f"; profile time (time scale K = {k:g})" if k != 1.0 else ""))
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


COLUMNS = {
    "mode": "mode", "layout": "layout", "rate_rps": "offered req/s", "tokens_per_s": "tok/s",
    "requests_per_s": "req/s", "token_rps": "tok req/s", "predicted_rps": "planner req/s",
    "simulated_rps": "simulator req/s", "ttft_p50_s": "TTFT p50 s", "ttft_p99_s": "TTFT p99 s",
    "tbt_p50_ms": "TBT p50 ms", "tbt_p99_ms": "TBT p99 ms",
    "tbt_p99_running_ms": "TBT p99 running ms", "slo_met": "SLO met",
    "goodput_rps": "goodput req/s", "unfinished": "cut",
    "cpu_ms_per_token": "CPU ms/tok", "cluster_cpu_cores": "cluster cores",
    "host_busy_cores": "host busy", "load_avg": "load", "cpu_bound": "CPU-bound",
    "time_scale": "K",
}
PER_REQUEST = {"cost_per_request": "cost/req", "energy_per_request_kj": "kJ/req"}


def main(argv: list[str]) -> int:
    if "mooncake" in {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--trace"} | {
            a.partition("=")[2] for a in argv if a.startswith("--trace=")}:
        from clients.kv_reuse import main as kv_reuse_main  # its own options

        return kv_reuse_main(argv)
    parser = argparse.ArgumentParser(prog="dejavu bench disagg",
                                     description=__doc__.splitlines()[0])
    model_arguments(parser, "gpt2", "small")
    parser.add_argument("--trace", choices=["conv", "code", "mooncake"], default="conv",
                        help="an Azure trace; mooncake: KV reuse on the Mooncake "
                        "conversation trace (clients/kv_reuse.py, its own options)")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per rate; with --duration, the planner's sample of the "
                        "trace (its mean lengths)")
    parser.add_argument("--duration", type=float,
                        help="instead of --requests: seconds of arrivals per rate (profile "
                        "time), so rate x duration requests each")
    parser.add_argument("--drain", type=float, default=math.inf,
                        help="cancel what still runs this many seconds (profile time) after "
                        "the last arrival (default: let every request finish)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                        help="with --profile: every step sleeps the profile's time x K, "
                        "arrivals come K times slower; figures are given in profile time")
    parser.add_argument("--rates", type=float, nargs="+",
                        help="arrival rates, req/s (default: --loads x the planner's "
                        "predicted colocated throughput)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5],
                        help="without --rates: arrival rates as multiples of the predicted "
                        "colocated throughput")
    parser.add_argument("--machines", nargs="+",
                        help="one core set per machine (default: each core of this host)")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        default=[m for m in MODES if m != "colocated-chunked"])
    parser.add_argument("--prefill-chunks", type=int, nargs="+", default=[512, 2048],
                        metavar="TOKENS",
                        help="colocated-chunked: one run per step budget (chunked prefill, "
                        "dejavu up --prefill-chunk)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per T-node microbatch")
    parser.add_argument("--prompt-scale", type=float, default=0.25,
                        help="trace prompt lengths times this")
    parser.add_argument("--output-scale", type=float, default=0.25,
                        help="trace output lengths times this")
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--ttft-slo", type=float, default=10.0)
    parser.add_argument("--tbt-slo", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="",
                        help="run every node on the emulated engine with this engine profile "
                        "(file or shipped name, e.g. splitwise-llama2-70b-h100); the planner "
                        "predicts from the same profile")
    parser.add_argument("--prefill-profile", default="",
                        help="with --profile: the P-nodes run this profile instead (Splitwise's "
                        "mixed pools, e.g. H100 prompt and A100 token machines); costs and "
                        "predictions count each machine as its own")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--pools", type=int, nargs=2, metavar=("P", "T"),
                        help="disaggregated as Splitwise's pools: P P-nodes and T T-nodes, "
                        "one machine each (default: the planner's split)")
    layout.add_argument("--split", type=int, nargs=3, metavar=("R", "DP", "DT"),
                        help="disaggregated as DejaVu's: R x (a P-node over DP machines "
                        "feeding a token pipeline of DT stages), as `dejavu plan` prints "
                        "'Rx (PDP+TDT)'")
    parser.add_argument("--depth", type=int, default=0,
                        help="colocated-pipeline: pipelines of this many stages, machines / "
                        "depth of them (DejaVu's Baseline; default: one over every machine)")
    parser.add_argument("--serving-cpu-ms", type=lambda x: x if x == "auto" else float(x),
                        default=0.0, metavar="SIGMA",
                        help="with the torch engine on CPU cores: the serving path's CPU ms "
                        "per token, which slows the engines sharing those cores; the "
                        "predictions count it ('auto': measured first, the emulated engine "
                        "sleeping the torch profile; 0: the engines have the cores alone)")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds each cluster may take to come up (a loaded host needs "
                        "more)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/disagg"))
    args = parser.parse_args(argv)
    k = args.time_scale
    if k != 1.0 and not args.profile:
        parser.error("--time-scale slows the emulated engine: give --profile")
    if args.prefill_profile and not args.profile:
        parser.error("--prefill-profile runs the emulated engine: give --profile too")
    from rich.progress import Progress

    from orchestrator.cluster.tritonserver import ServerError
    from orchestrator.control.auth import load_secret
    from orchestrator.engine.config import ModelConfig

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        machines = [Devices.parse(m) for m in
                    (args.machines or [f"cpu:{c}" for c in sorted(os.sched_getaffinity(0))])]
        if len(machines) < 2:
            raise ValueError("disaggregation needs at least 2 machines")
        model_dir = (args.model or dummy_model(args.out, args.arch, args.preset)).resolve()
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        lengths = scaled_requests(args.trace, args.requests, args.seed, args.prompt_scale,
                                  args.output_scale, args.max_prompt, args.max_new)
        print(f"{len(lengths)} requests from the {args.trace} trace: prompts "
              f"{min(p for p, _ in lengths)}-{max(p for p, _ in lengths)} tokens, outputs "
              f"{min(n for _, n in lengths)}-{max(n for _, n in lengths)}; profiling...",
              flush=True)
        split = given_split(args.pools, args.split, len(machines))
        depth = args.depth or len(machines)
        if depth < 1 or len(machines) % depth:
            raise ValueError(f"--depth {depth} does not divide the {len(machines)} machines")
        if args.serving_cpu_ms and (args.profile or machines[0].kind != "cpu"):
            raise ValueError("--serving-cpu-ms models the torch engine on CPU cores (no "
                             "--profile, cpu machines)")
        modes = run_modes(args.modes, args.prefill_chunks)
        pred = predictions(model_dir, lengths, args.batch, machines[0], len(machines),
                           args.profile, split, args.prefill_profile, depth,
                           tuple(args.prefill_chunks))
        max_seq_len = args.max_prompt + args.max_new
        if args.serving_cpu_ms:
            sigma_ms = args.serving_cpu_ms
            if sigma_ms == "auto":  # at the highest rate asked for, on the same requests
                rate = max(args.rates or [f * pred["predicted"]["colocated"] for f in args.loads])
                sigma_ms = 1e3 * serving_cpu_s(
                    model_dir, pred["cost"], machines, args.out / "serving-cpu", args.batch,
                    max_seq_len, make_jobs(lengths, rate, vocab, args.seed), args.start_timeout)
            cores = len({c for machine in machines for c in machine.ids})
            pred = on_shared_host(pred, sigma_ms / 1e3, cores)
            print(f"the serving path, {sigma_ms:.2f} ms of CPU per token on the engines' {cores} "
                  "cores, slows them x" + ", x".join(
                      f"{s:.2f} ({mode})" for mode, s in pred["slowdown"].items()), flush=True)
        rates = args.rates or [f * pred["predicted"]["colocated"] for f in args.loads]
        counts = {r: max(2, round(r * args.duration)) if args.duration else len(lengths)
                  for r in rates}
        if max(counts.values()) > len(lengths):  # each rate sends its first rate x duration
            lengths = scaled_requests(args.trace, max(counts.values()), args.seed,
                                      args.prompt_scale, args.output_scale, args.max_prompt,
                                      args.max_new)
        print(f"planner: Y/t {pred['Y/t']:.1f}, m {pred['m']:.3f}, picks {pred['pick']}, "
              "real split D_p "
              f"{pred['real_split'][0]:.2f} D_t {pred['real_split'][1]:.2f}; predicted colocated "
              f"{pred['predicted']['colocated']:.2f} req/s, colocated pipeline "
              f"{pred['predicted']['colocated-pipeline']:.2f} req/s, {pred['split']} "
              f"{pred['predicted']['disaggregated']:.2f} req/s", flush=True)
        check_depths(args.modes, pred["split"], depth,
                     ModelConfig.from_dir(model_dir).num_layers)
        points: list[Point] = []
        with Progress() as progress:
            task = progress.add_task("requests", total=len(modes) * sum(counts.values()))
            lock = threading.Lock()

            def advance() -> None:
                with lock:
                    progress.advance(task)

            for mode in modes:
                with cluster_for(mode, model_dir, machines, args.out / "cluster", args.batch,
                                 max_seq_len, pred["split"], args.profile, k,
                                 args.start_timeout, args.prefill_profile,
                                 depth) as cluster:
                    layout = {"colocated": f"{len(machines)}x colocated",
                              "colocated-pipeline": str(pred["layouts"][mode]),
                              }.get(mode, str(pred["split"]))
                    if prefill_chunk_of(mode):
                        layout = f"{len(machines)}x colocated, {prefill_chunk_of(mode)}-token steps"
                    url = cluster.frontend.grpc_url
                    secret = load_secret(cluster.secret_file)
                    # Every node's first request is slow; a few tokens each warm it (a
                    # trace's long output would take minutes at a large time scale).
                    warm = make_jobs([(p, min(n, 4)) for p, n in lengths[:len(machines)]],
                                     100.0, vocab, args.seed + 1)
                    replay(url, secret, warm)
                    groups = cluster_groups(cluster)
                    for rate in rates:
                        jobs = make_jobs(lengths[:counts[rate]], rate, vocab, args.seed)
                        with CpuMeter(groups) as meter:
                            times = replay(url, secret, jobs, advance, k, args.drain)
                        wait_idle(cluster)
                        planned, simulated = expected(pred["costs"][mode], requests_of(jobs),
                                                      pred["layouts"][mode], args.batch,
                                                      args.drain, pred["prompt_cost"],
                                                      pred["m"], prefill_chunk_of(mode))
                        point = summarize(
                            mode, layout, rate, jobs, times, pred["prompt_s_per_token"],
                            pred["step_s"], args.ttft_slo, args.tbt_slo, planned, k)
                        point.simulated_rps = simulated
                        save_times(args.out / f"times-{mode}-{rate:.4g}.json", layout, jobs,
                                   times)
                        assert meter.use is not None
                        point = point.with_cpu(meter.use, sum(len(t) - 1 for t in times))
                        points.append(per_request(point, fleet(
                            pred["layouts"][mode], len(machines), args.profile,
                            args.prefill_profile)))
                        # After every rate: a later failure (a cluster that does not come
                        # up on a loaded host) keeps what was measured.
                        write_csv(args.out / "disagg.csv", points)
    except (ServerError, RuntimeError, ValueError, OSError) as exc:
        print(f"dejavu bench disagg: {exc}", file=sys.stderr)
        return 1
    points.sort(key=lambda p: (p.rate_rps, p.mode))
    write_csv(args.out / "disagg.csv", points)
    plot(points, args.out / "disagg.png")
    print(markdown(points, COLUMNS | (PER_REQUEST if args.profile else {})))
    print(f"\nunloaded (bare engine): prefill {pred['prompt_s_per_token'] * 1e3:.2f} ms/token, "
          f"step {pred['step_s'] * 1e3:.1f} ms (at batch {args.batch}: "
          f"{pred['batch_step_s'] * 1e3:.1f} ms); SLO TTFT <= {args.ttft_slo:g}x, mean TBT <= "
          f"{args.tbt_slo:g}x; machines {' '.join(map(str, machines))}")
    if args.profile:
        from orchestrator.engine.emulated import load_emulated_engine
        from orchestrator.profiles.profile import load_profile

        engine = load_emulated_engine(str(model_dir), load_profile(args.profile), max_seq_len=1)
        print(f"emulated engine on {args.profile}: KV bytes per token {engine.kv_scale:.3g}x "
              f"the profile's; time scale K = {k:g} (steps slept x K; times above / K, rates "
              "x K: profile time)")
    bound = [p for p in points if p.cpu_bound]
    print(f"CPU-bound (cluster > half of {os.cpu_count()} cores, or host > 80% busy): "
          f"{len(bound)} of {len(points)} rates; cluster CPU "
          f"{min(p.cpu_ms_per_token for p in points):.2f}-"
          f"{max(p.cpu_ms_per_token for p in points):.2f} ms per token; load average "
          f"{min(p.load_avg for p in points):.1f}-{max(p.load_avg for p in points):.1f}")
    print(f"wrote {args.out}/disagg.csv, disagg.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
