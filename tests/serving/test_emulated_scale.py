"""Sixteen emulated nodes on one host: real tritonservers, the orchestrator, NIXL KV,
replication and a warm spare, with the engine's compute replaced by Splitwise's H100
Llama-2-70B profile. The cluster replays the Azure conversation trace token-exactly, loses
a T-stage (kill -9, not a head) with requests in flight, resumes them from the replicas on
the spare, and serves on. It prints what it measured: time to come up, memory, the serving
path's CPU idle and under load, and the client's pause at the kill.

Layout: 3 P-nodes + 3 token pipelines of depth 4 + 1 warm spare = 16 nodes (plus the
frontend, the controller, the supervisor and its watchdog). Depth 4 is the tiny Llama's
layer count (one layer per stage): the deepest pipeline, so the most stages to lose and the
most replication traffic; three of them take requests side by side, three P-nodes keep the
prompts of a trace burst from queueing, and the spare makes the kill a role move, not a
process start.

Lengths: the trace's own prompts (capped at :data:`MAX_PROMPT`, which none of the requests
used here exceeds) and outputs capped at :data:`MAX_NEW` tokens (the trace's median is 129)
to keep the test short; the first round keeps the trace's arrival times.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest
from cluster_helpers import assert_all_freed, held, metric, module_cluster, stream_orchestrator

from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import Cluster, read_state
from orchestrator.cluster.tritonserver import alive, is_ready, proc_stat
from orchestrator.cluster.watchdog import read_pid
from orchestrator.control.auth import load_secret
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.emulated import emulated_reference
from orchestrator.planner.workload import load_trace

pytestmark = pytest.mark.slow
PROFILE = "splitwise-llama2-70b-h100"
LAYOUT = dict(prefill=3, decode=3, decode_depth=4, spares=1)  # 3 + 3 x 4 + 1 = 16 nodes
NODES = 16
MAX_PROMPT = 4096  # tokens; the conversation trace's longest is 14,050
MAX_NEW = 64  # tokens per request; the trace's median is 129
# Trace rows: the replay, the kill round (sent at once: all in flight at the kill), after.
REPLAY, KILLED, AFTER = range(0, 24), range(24, 36), range(36, 48)
STARTED = 0.0  # seconds the cluster took to come up


class _Timed:
    """:meth:`Cluster.up` (at the trace's context, not :func:`cluster_up`'s), with the time
    it took to come up recorded."""

    def __init__(self, model: Path, run_dir: Path, **kwargs) -> None:
        self.model, self.run_dir, self.kwargs = model, run_dir, kwargs

    def __enter__(self) -> Cluster:
        global STARTED
        began = time.monotonic()
        self.context = Cluster.up(self.model, run_dir=self.run_dir, **self.kwargs)
        cluster = self.context.__enter__()
        STARTED = time.monotonic() - began
        return cluster

    def __exit__(self, *exc: object) -> None:
        self.context.__exit__(*exc)


# The default heartbeat timeout (5 s), not the fault tests' 3 s: the kill is seen from the
# process's end (the supervisor's pid watch) at once, and on a shared 2-core host at load 50
# a P-node's heartbeats were once late by 3 s (declared dead, restarted: no request lost).
sixteen = module_cluster("sixteen", _Timed, max_seq_len=MAX_PROMPT + MAX_NEW, profile=PROFILE,
                         openai=False, **LAYOUT)


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float  # seconds after the round starts


def trace_jobs(rows: range, vocab: int, arrivals: bool = True) -> list[Job]:
    """The conversation trace's rows ``rows``: prompts of its lengths (random ids, seeded by
    the row), outputs capped at MAX_NEW; its arrival times from the first row's, or all at 0."""
    trace = load_trace("conv")
    first = trace[rows.start].arrival
    jobs = []
    for i in rows:
        r = trace[i]
        rng = random.Random(i)
        jobs.append(Job([rng.randrange(vocab) for _ in range(min(r.prompt_len, MAX_PROMPT))],
                        min(r.output_len, MAX_NEW), r.arrival - first if arrivals else 0.0))
    return jobs


@dataclass(eq=False)
class Request(threading.Thread):
    """One job streamed from the frontend's orchestrator model at its arrival time; its
    tokens and when each response came."""

    url: str
    secret: bytes
    job: Job
    start_at: float
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # one per response
    sent: float = 0.0
    error: Exception | None = None

    def __post_init__(self) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        time.sleep(max(0.0, self.start_at + self.job.arrival - time.monotonic()))  # its arrival
        self.sent = time.monotonic()
        try:
            for ids in stream_orchestrator(self.url, self.job.prompt_ids, self.job.max_tokens,
                                           self.secret):
                self.ids += ids
                self.times.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def send(cluster: Cluster, jobs: list[Job]) -> list[Request]:
    secret = load_secret(cluster.secret_file)
    start_at = time.monotonic()
    requests = [Request(cluster.frontend.grpc_url, secret, job, start_at) for job in jobs]
    for r in requests:
        r.start()
    return requests


def finish(requests: list[Request], timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    for r in requests:
        r.join(max(0.0, deadline - time.monotonic()))
        assert not r.is_alive(), "a request still streaming at the deadline"


def longest_wait(requests: list[Request]) -> float:
    """The longest a client waited between two responses."""
    return max(b - a for r in requests for a, b in pairwise(r.times))


def assert_token_exact(requests: list[Request], vocab: int) -> None:
    assert [str(r.error) for r in requests if r.error] == []
    for r in requests:
        assert r.ids == emulated_reference(r.job.prompt_ids, r.job.max_tokens, vocab)


# -- what the cluster's processes use ------------------------------------------------

def cluster_groups(run_dir: Path) -> set[int]:
    """The process groups of the cluster (each node's tritonserver, its stubs and token
    service; the controller; the supervisor and its watchdog), from its state file."""
    state = read_state(run_dir)
    pids = [n.get("pid") for n in state["nodes"]] + [state["controller"]["pid"]]
    pids += [read_pid(run_dir, role) for role in ("supervisor", "watchdog")]
    return {pid for pid in pids if pid}


def members(groups: set[int]) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(proc_stat(int(entry.name))[2]) in groups:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return found


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (those still there)."""
    total = 0.0
    for pid in pids:
        try:
            fields = proc_stat(pid)
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) of ``pids`` in MiB: RSS counts a shared page in every process mapping it
    (torch's libraries in each of them), PSS splits it among them: their real footprint."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key, value = line.split(":", 1)
                    if key in ("Rss", "Pss"):
                        kb = int(value.split()[0])
                        rss, pss = (rss + kb, pss) if key == "Rss" else (rss, pss + kb)
        except OSError:
            continue
    return rss / 1024, pss / 1024


class CpuWindow:
    """Cores the cluster's processes used from ``__init__`` to :meth:`cores` (at least
    ``min_s``: the kernel counts CPU time in 10 ms ticks)."""

    def __init__(self, run_dir: Path, min_s: float = 2.0) -> None:
        self.pids, self.min_s = members(cluster_groups(run_dir)), min_s
        self.began, self.cpu = time.monotonic(), cpu_s(self.pids)

    def cores(self) -> float:
        while (elapsed := time.monotonic() - self.began) < self.min_s:
            time.sleep(0.1)
        return (cpu_s(self.pids) - self.cpu) / elapsed


MEASURED: dict[str, float] = {}


def test_sixteen_nodes_come_up_and_replay_the_conversation_trace(sixteen, model):
    vocab = ModelConfig.from_dir(model).vocab_size
    state = read_state(sixteen.run_dir)
    assert sum(n["role"] != "frontend" for n in state["nodes"]) == NODES
    pids = members(cluster_groups(sixteen.run_dir))
    MEASURED["up_s"] = STARTED
    MEASURED["processes"] = len(pids)
    MEASURED["rss_mib"], MEASURED["pss_mib"] = memory_mib(pids)
    assert MEASURED["pss_mib"] < 12 * 1024  # half this 24 GiB host (6.5 GiB measured)
    idle = CpuWindow(sixteen.run_dir, min_s=5.0)  # a measuring window, not a wait for state
    MEASURED["idle_cores"] = idle.cores()

    jobs = trace_jobs(REPLAY, vocab)
    load = CpuWindow(sixteen.run_dir)
    requests = send(sixteen, jobs)
    finish(requests)
    MEASURED["load_cores"] = load.cores()
    assert_token_exact(requests, vocab)
    MEASURED["replay_s"] = max(r.times[-1] for r in requests) - min(r.sent for r in requests)
    MEASURED["tokens"] = sum(len(r.ids) for r in requests)
    MEASURED["normal_pause_s"] = longest_wait(requests)
    # every token pipeline served some of them
    assert all(metric_admitted(sixteen, p) > 0 for p in range(LAYOUT["decode"]))
    assert_all_freed(sixteen)
    print(f"\n16 emulated nodes ({len(pids)} processes): up in {STARTED:.1f} s, "
          f"RSS {MEASURED['rss_mib']:.0f} MiB, PSS {MEASURED['pss_mib']:.0f} MiB; "
          f"CPU idle {MEASURED['idle_cores']:.2f} cores, replaying {len(jobs)} conversation "
          f"requests ({MEASURED['tokens']} tokens in {MEASURED['replay_s']:.1f} s) "
          f"{MEASURED['load_cores']:.2f} cores")


def metric_admitted(cluster: Cluster, pipeline: int) -> float:
    """Requests the head of token pipeline ``pipeline`` admitted so far."""
    head = next(n.server for n in cluster.role("decode")
                if n.config.pipeline == pipeline and n.config.stage == 0)
    return metric(head, "dejavu_requests")


def test_a_killed_t_stage_moves_to_the_spare_and_the_cluster_serves_on(sixteen, model):
    vocab = ModelConfig.from_dir(model).vocab_size
    before = read_state(sixteen.run_dir)
    spare = next(n for n in before["nodes"] if n["name"] == "spare0")
    requests = send(sixteen, trace_jobs(KILLED, vocab, arrivals=False))
    deadline = time.monotonic() + 60
    while not all(r.ids or r.error for r in requests):  # every one admitted, streaming
        assert time.monotonic() < deadline, "no tokens before the kill"
        time.sleep(0.05)
    # Stage 2 (of 0-3) of the pipeline holding the most requests: recovered from the
    # replicas stage 3 holds, on the spare.
    busy = max(held(sixteen, "s2").items(), key=lambda item: item[1]["kv"])
    victim = busy[0]
    in_flight = [r for r in requests if len(r.ids) < r.job.max_tokens]
    killed_at, killed_wall = time.monotonic(), time.time()
    assert chaos.main(["kill", victim, "--dir", str(sixteen.run_dir)]) == 0  # waits for its end
    MEASURED["ended_s"] = time.monotonic() - killed_at
    finish(requests)
    assert_token_exact(requests, vocab)
    after = read_state(sixteen.run_dir)
    stage = next(n for n in after["nodes"] if n["name"] == victim)
    assert (stage["grpc"], stage["pid"]) == (spare["grpc"], spare["pid"])  # the spare took it
    resumed = [r for r in after.get("repairs", []) if r["outcome"] == "resumed"]
    assert len(resumed) == 1, after.get("repairs")
    MEASURED["resumed_s"] = resumed[0]["at"] - killed_wall
    # The client's pause (as ``dejavu bench recovery`` has it): the longest wait between two
    # responses across the kill, of the requests in flight then.
    MEASURED["pause_s"] = max(b - a for r in in_flight for a, b in pairwise(r.times)
                              if b > killed_at)
    MEASURED["in_flight"] = len(in_flight)

    # A new spare where the lost node was, loaded: 16 nodes again.
    deadline = time.monotonic() + 120
    while True:
        fresh = next(n for n in read_state(sixteen.run_dir)["nodes"] if n["name"] == "spare0")
        if fresh.get("pid") and alive(fresh["pid"]) and is_ready(fresh["http"]):
            break
        assert time.monotonic() < deadline, "no new spare"
        time.sleep(0.2)
    MEASURED["new_spare_s"] = time.monotonic() - killed_at
    assert_all_freed(sixteen)

    requests = send(sixteen, trace_jobs(AFTER, vocab))
    finish(requests)
    assert_token_exact(requests, vocab)
    assert_all_freed(sixteen)
    print(f"\nkilled {victim} with {len(in_flight)} requests in flight: all token-exact; "
          f"the longest client pause {MEASURED['pause_s']:.2f} s (undisturbed "
          f"{MEASURED.get('normal_pause_s', 0):.2f} s): the killed node took "
          f"{MEASURED['ended_s']:.2f} s to end, its pipeline resumed on the spare "
          f"{MEASURED['resumed_s']:.2f} s after the kill; a new spare ready "
          f"{MEASURED['new_spare_s']:.1f} s after the kill; {len(AFTER)} more served; "
          f"repairs: {[(r['pipeline'], r['outcome']) for r in after['repairs']]}")
