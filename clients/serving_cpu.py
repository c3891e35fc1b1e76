"""``dejavu bench serving --cpu``: the cluster's CPU per streamed token, by process role.

An emulated 1P+1T cluster (real tritonservers, orchestrator and KV transfer; the
engine sleeps a GPU profile's step times, so every CPU cycle left is the serving
path's) takes ``c`` concurrent gRPC streams to ``ensemble``, each one request of
``--max-tokens`` tokens that run to the end (``end_id`` -1), at each concurrency.
Every process of the cluster is read from ``/proc/<pid>/stat`` (user + system
time) before and after a point; their CPU over the tokens streamed is the cost
per token, summed by role (the frontend's ``orchestrator`` stub, the
tritonservers, the T-node's token service, ...). Each stream's tokens are checked
against :func:`~orchestrator.engine.emulated.emulated_reference`.

Tokens/s is the rate while all ``c`` streams are decoding (from the last first
token to the first last token), against the profile's for that batch
(``c / decode_s(c, context)``). CPU time per token holds on a shared host: a
process waiting for a core spends none. Wall time (tokens/s) does not: on a
host whose cores other work takes, the serving path's threads wait for them.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from clients.breakdown import _label
from clients.common import PROMPTS, _live_processes
from orchestrator.cluster.tritonserver import proc_stat

PROFILE = "splitwise-llama2-70b-h100"
# Process roles, in the report's order: (role, does a label belong to it).
ROLES = (
    ("frontend orchestrator stub", lambda label: label.startswith(
        "frontend orchestrator (Python stub)")),
    ("frontend other stubs", lambda label: label.startswith("frontend ")
     and label.endswith("(Python stub)")),
    ("tritonservers", lambda label: label.endswith(" tritonserver")),
    ("T-node token service", lambda label: label.endswith(" token service")),
    ("decode stub", lambda label: label.endswith(" decode (Python stub)")),
    ("prefill stub", lambda label: label.endswith(" prefill (Python stub)")),
    ("other", lambda label: True),  # controller, supervisor, watchdog, OpenAI API
)


def role_of(label: str) -> str:
    return next(role for role, matches in ROLES if matches(label))


def column(role: str) -> str:
    """A role's CSV column: its CPU per token."""
    return role.replace(" ", "_").replace("-", "_") + "_ms"


@dataclass
class Stream:
    """One request's token ids, and when each response that carried some arrived."""

    ids: list[int]
    arrivals: list[float]  # perf_counter, one per token (a response of n: n times)


def label_of(pid: int) -> str:
    """Breakdown's label, and a model instance's name where a model has several (a stub's
    argument: ``orchestrator_0_1``)."""
    label = _label(pid)
    if label.endswith("(Python stub)"):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        instance = next((a for a in argv if re.fullmatch(r"\w+_\d+_(\d+)", a)), "")
        if instance and not instance.endswith("_0_0"):
            label += f" {instance}"
    return label


def cluster_pids(pgids: set[int]) -> dict[int, str]:
    """Every live process of the cluster's process groups, by its label."""
    found = {}
    for pid, stat in _live_processes():
        if int(stat[2]) in pgids:
            try:
                found[pid] = label_of(pid)
            except OSError:  # gone meanwhile
                continue
    return found


def cpu_times(pids: dict[int, str]) -> dict[int, float]:
    """Each process's user + system seconds (every thread), from /proc/<pid>/stat."""
    tick, times = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = proc_stat(pid)
        except (OSError, IndexError):
            continue
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    return times


def spent_by_label(pgids: set[int], before: dict[int, float], labels: dict[int, str]
                   ) -> dict[str, float]:
    """CPU seconds each label spent since ``before`` (a process started since: all of its)."""
    labels = {**labels, **cluster_pids(pgids)}
    after = cpu_times(labels)
    spent: dict[str, float] = {}
    for pid, seconds in after.items():
        spent[labels[pid]] = spent.get(labels[pid], 0.0) + seconds - before.get(pid, 0.0)
    return spent


async def _streams(url: str, prompts: list[str], max_tokens: int, timeout_s: float
                   ) -> list[Stream]:
    import tritonclient.grpc.aio as grpcclient

    from clients.generate import _inputs

    client = grpcclient.InferenceServerClient(url)

    async def one(prompt: str) -> Stream:
        async def request():
            yield {"model_name": "ensemble", "enable_empty_final_response": True,
                   "inputs": _inputs([prompt], True, {"max_tokens": max_tokens, "end_id": -1})}

        stream = Stream([], [])
        responses = client.stream_infer(request())
        try:
            while True:
                result, error = await asyncio.wait_for(anext(responses), timeout_s)
                if error is not None:
                    raise RuntimeError(f"ensemble: {error}")
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    stream.ids += ids.reshape(-1).tolist()
                    stream.arrivals += [time.perf_counter()] * ids.size
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return stream
        except StopAsyncIteration:
            return stream
        finally:
            responses.cancel()

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def steady_rate(streams: list[Stream]) -> tuple[float, float]:
    """(tokens/s, seconds) while every stream was decoding: from the last first token to
    the first last token (NaN if they never overlapped)."""
    start = max(s.arrivals[0] for s in streams)
    end = min(s.arrivals[-1] for s in streams)
    if end <= start:
        return float("nan"), 0.0
    tokens = sum(start < t <= end for s in streams for t in s.arrivals)
    return tokens / (end - start), end - start


def settle(pgids: set[int], below_cores: float = 0.1, timeout_s: float = 60.0) -> None:
    """Until the idle cluster spends less than ``below_cores`` over a second (a process
    that just started, as the supervisor, spends its first seconds importing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        labels = cluster_pids(pgids)
        before = cpu_times(labels)
        time.sleep(1.0)
        if sum(spent_by_label(pgids, before, labels).values()) < below_cores:
            return


def point(cluster, concurrency: int, max_tokens: int, expected: dict[str, list[int]],
          profile, prompt_tokens: float, timeout_s: float = 300.0) -> dict:
    """One concurrency: its CPU per token by role and label, and its tokens/s."""
    from clients.disagg import cluster_groups

    pgids = cluster_groups(cluster)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    labels = cluster_pids(pgids)
    before = cpu_times(labels)
    begin = time.perf_counter()
    streams = asyncio.run(_streams(cluster.frontend.grpc_url, prompts, max_tokens, timeout_s))
    wall = time.perf_counter() - begin
    spent = spent_by_label(pgids, before, labels)
    for prompt, stream in zip(prompts, streams, strict=True):
        if stream.ids != expected[prompt]:
            raise RuntimeError(f"{prompt!r} streamed {len(stream.ids)} tokens that are not "
                               "the reference's")
    tokens = sum(len(s.ids) for s in streams)
    rate, window = steady_rate(streams)
    profile_rate = concurrency / profile.decode_s(concurrency, prompt_tokens + max_tokens / 2)
    row = {"concurrency": concurrency, "tokens": tokens, "wall_s": wall,
           "tokens_per_s": rate, "steady_s": window, "profile_tokens_per_s": profile_rate,
           "of_profile": rate / profile_rate,
           "cluster_ms": 1e3 * sum(spent.values()) / tokens}
    by_role = dict.fromkeys((role for role, _ in ROLES), 0.0)
    for label, seconds in spent.items():
        by_role[role_of(label)] += seconds
    row |= {column(role): 1e3 * seconds / tokens for role, seconds in by_role.items()}
    row["frontend_stubs_ms"] = row[column("frontend orchestrator stub")] + row[
        column("frontend other stubs")]
    row["by_process_ms"] = "; ".join(f"{label} {1e3 * s / tokens:.3f}" for label, s in
                                     sorted(spent.items(), key=lambda kv: -kv[1]) if s > 0)
    return row


COLUMNS = {
    "concurrency": "streams", "tokens_per_s": "tok/s (all decoding)",
    "profile_tokens_per_s": "profile tok/s", "cluster_ms": "cluster ms CPU/token",
    "frontend_stubs_ms": "frontend stubs",
    **{column(role): role for role, _ in ROLES},
}


def run_cpu(model_dir: Path, out: Path, concurrency: list[int], max_tokens: int,
            batch: int, profile_name: str, frontend_instances: int = 1,
            stream_interval: int = 1) -> list[dict]:
    """Every concurrency on one fresh emulated 1P+1T cluster; a warm-up stream first."""
    from orchestrator.cluster.launcher import Cluster
    from orchestrator.engine.config import ModelConfig
    from orchestrator.engine.emulated import emulated_reference
    from orchestrator.engine.tokenizer import load_tokenizer
    from orchestrator.profiles.profile import load_profile

    tokenizer, vocab = load_tokenizer(model_dir), ModelConfig.from_dir(model_dir).vocab_size
    encoded = {p: tokenizer.encode(p).ids for p in PROMPTS}
    expected = {p: emulated_reference(ids, max_tokens, vocab) for p, ids in encoded.items()}
    prompt_tokens = statistics.mean(len(ids) for ids in encoded.values())
    profile = load_profile(profile_name)
    settings = {}
    if frontend_instances != 1:
        settings["frontend_instances"] = frontend_instances
    if stream_interval != 1:
        settings["stream_interval"] = stream_interval
    rows = []
    with Cluster.up(model_dir, run_dir=out / "cluster", prefill=1, decode=1,
                    max_batch=batch, profile=profile_name, openai=False,
                    max_seq_len=max(len(i) for i in encoded.values()) + max_tokens + 8,
                    **settings) as cluster:
        point(cluster, 1, 8, {p: e[:8] for p, e in expected.items()}, profile,
              prompt_tokens)  # warm-up: first calls load code and open streams
        from clients.disagg import cluster_groups

        settle(cluster_groups(cluster))
        for c in concurrency:
            rows.append(point(cluster, c, max_tokens, expected, profile, prompt_tokens))
            print(f"c={c}: {rows[-1]['cluster_ms']:.3f} ms CPU/token, "
                  f"{rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    return rows

