"""Splitwise's cluster (ISCA 2024 §IV): prompt, token and mixed pools of whole-model machines.

- Routing (cluster-level scheduler): each request gets a prompt machine and a
  token machine at arrival, each by join-the-shortest-queue on pending tokens
  (queued prompt tokens; KV tokens of assigned requests). When the shortest
  queue of a pool is over its threshold, the request goes to the mixed pool.
- Prompt machines (machine-level scheduler): FCFS batches capped at
  ``prompt_batch_tokens`` (2048 by default; one longer prompt runs alone).
- Token machines: FCFS continuous batching until KV memory runs out.
- Mixed machines: prompts first (they preempt token steps), tokens otherwise;
  a request whose prompt ran on a mixed machine decodes there too.
- KV transfer: serialized (after the prompt, all layers) below a prompt size,
  layer-wise (overlapped; the prompt slows by the profile's m and only the
  link overhead plus the last layer's transfer is exposed) above it. The
  crossover comes from the profile's KV bytes per token, m and the link.

Simplifications: a batch's prompt time is linear in its tokens; a token step
costs the profile's t whatever the batch size (memory-bound); no preemption
limits or priority aging on mixed machines; no power or heterogeneity.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from orchestrator.planner.perf_model import Profile
from orchestrator.planner.simulator import EventLoop, RequestTimes, SimResult, summarize
from orchestrator.planner.workload import Request


@dataclass(frozen=True)
class Link:
    """The KV link between machines (defaults: 200 Gb/s InfiniBand, Splitwise's A100s)."""

    bandwidth: float = 25e9  # bytes/s
    layerwise_overhead: float = 0.008  # s exposed by layer-wise transfer (Splitwise Fig. 14)


@dataclass(frozen=True)
class Pools:
    prompt: int
    token: int
    mixed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt, self.token, self.mixed) < 0:
            raise ValueError(f"pool sizes must be >= 0, got {self}")
        if self.mixed == 0 and (self.prompt == 0 or self.token == 0):
            raise ValueError(f"without a mixed pool both prompt and token pools are needed: {self}")

    @property
    def machines(self) -> int:
        return self.prompt + self.token + self.mixed

    def __str__(self) -> str:
        return f"P{self.prompt}+T{self.token}+M{self.mixed}"


def serialized_transfer_time(profile: Profile, link: Link, prompt_len: int) -> float:
    return prompt_len * profile.kv_bytes_per_token / link.bandwidth


def layerwise_exposed_time(profile: Profile, link: Link, prompt_len: int) -> float:
    """Link overhead + the last layer's transfer + the prompt's slowdown (m - 1)."""
    last_layer = serialized_transfer_time(profile, link, prompt_len) / profile.L
    slowdown = (profile.m - 1) * profile.prompt_time_per_token * prompt_len
    return link.layerwise_overhead + last_layer + slowdown


def layerwise_threshold(profile: Profile, link: Link) -> float:
    """Prompt tokens from which layer-wise transfer exposes less time; inf if never."""
    per_token = (
        profile.kv_bytes_per_token / link.bandwidth * (1 - 1 / profile.L)
        - (profile.m - 1) * profile.prompt_time_per_token
    )
    return link.layerwise_overhead / per_token if per_token > 0 else math.inf


@dataclass(eq=False)
class _Job:
    request: Request
    token_machine: _Machine | None = None
    layerwise: bool = False
    first_token: float = math.nan
    tokens: list[float] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return self.request.prompt_len + self.request.output_len


class _Machine:
    def __init__(self, role: str, kv_capacity: int):
        self.role, self.kv_capacity = role, kv_capacity
        self.prompts: deque[_Job] = deque()
        self.waiting: deque[_Job] = deque()  # prompt done, KV here, not yet batched
        self.active: list[_Job] = []
        self.kv_used = 0
        self.queued_prompt_tokens = 0
        self.assigned_kv_tokens = 0  # KV of every request assigned for decoding
        self.busy = False
        self.busy_seconds = 0.0


class SplitwiseCluster:
    def __init__(
        self, profile: Profile, pools: Pools, prompt_batch_tokens: int = 2048,
        link: Link | None = None, prompt_overflow_batches: float = 2.0,
    ):
        if prompt_batch_tokens < 1:
            raise ValueError(f"prompt_batch_tokens must be >= 1, got {prompt_batch_tokens}")
        free = profile.M - profile.L * profile.W0
        if free <= 0:
            raise ValueError("the model's weights do not fit in one machine's memory")
        self.kv_capacity = int(free / profile.kv_bytes_per_token)
        self.profile, self.pools, self.loop = profile, pools, EventLoop()
        self.link = link or Link()
        self.batch_cap = prompt_batch_tokens
        self.prompt_overflow = prompt_overflow_batches * prompt_batch_tokens
        self.threshold = layerwise_threshold(profile, self.link)
        make = lambda role, n: [_Machine(role, self.kv_capacity) for _ in range(n)]  # noqa: E731
        self.prompt_pool = make("prompt", pools.prompt)
        self.token_pool = make("token", pools.token)
        self.mixed_pool = make("mixed", pools.mixed)
        self.jobs: list[_Job] = []
        self.prompt_batch_tokens: list[int] = []  # every prompt batch run, for inspection

    def run(self, requests: list[Request]) -> SimResult:
        too_long = [r for r in requests if r.prompt_len + r.output_len > self.kv_capacity]
        if too_long:
            raise ValueError(
                f"{len(too_long)} requests need more KV than a machine holds "
                f"({self.kv_capacity} tokens), e.g. request {too_long[0].id}"
            )
        for r in requests:
            self.loop.at(r.arrival, lambda r=r: self._arrive(r))
        self.loop.run()
        unfinished = [j for j in self.jobs if len(j.tokens) < j.request.output_len]
        if unfinished or len(self.jobs) != len(requests):
            raise RuntimeError(f"simulation ended with {len(unfinished)} unfinished requests")
        machines = self.prompt_pool + self.token_pool + self.mixed_pool
        return summarize(
            "splitwise", str(self.pools), self.pools.machines,
            [RequestTimes(j.request, j.first_token, j.tokens) for j in self.jobs],
            sum(m.busy_seconds for m in machines),
        )

    # Cluster-level scheduler -------------------------------------------------

    def _arrive(self, request: Request) -> None:
        job = _Job(request, layerwise=request.prompt_len >= self.threshold)
        self.jobs.append(job)
        prompt_at = _shortest(self.prompt_pool, lambda m: m.queued_prompt_tokens)
        if prompt_at is None or prompt_at.queued_prompt_tokens > self.prompt_overflow:
            prompt_at = _shortest(self.mixed_pool, _mixed_load) or prompt_at
        if prompt_at.role == "mixed":
            job.token_machine = prompt_at
        else:
            token_at = _shortest(self.token_pool, lambda m: m.assigned_kv_tokens)
            if token_at is None or token_at.assigned_kv_tokens + job.kv_tokens > self.kv_capacity:
                token_at = _shortest(self.mixed_pool, _mixed_load) or token_at
            job.token_machine = token_at
        job.token_machine.assigned_kv_tokens += job.kv_tokens
        prompt_at.prompts.append(job)
        prompt_at.queued_prompt_tokens += request.prompt_len
        self._kick(prompt_at)

    # Machine-level scheduler -------------------------------------------------

    def _kick(self, machine: _Machine) -> None:
        if machine.busy:
            return
        if machine.prompts:
            self._run_prompts(machine)
        else:
            self._admit(machine)
            if machine.active:
                self._run_token_step(machine)

    def _busy_for(self, machine: _Machine, seconds: float, then) -> None:
        machine.busy = True
        machine.busy_seconds += seconds

        def done() -> None:
            machine.busy = False
            then()
            self._kick(machine)

        self.loop.after(seconds, done)

    def _run_prompts(self, machine: _Machine) -> None:
        batch, tokens = [], 0
        while machine.prompts and (
            not batch or tokens + machine.prompts[0].request.prompt_len <= self.batch_cap
        ):
            job = machine.prompts.popleft()
            batch.append(job)
            tokens += job.request.prompt_len
        machine.queued_prompt_tokens -= tokens
        self.prompt_batch_tokens.append(tokens)
        streams = any(j.layerwise and j.token_machine is not machine for j in batch)
        seconds = self.profile.prompt_time_per_token * tokens * (self.profile.m if streams else 1)

        def finish() -> None:
            for job in batch:
                job.first_token = self.loop.now
                self._hand_over(job, machine)

        self._busy_for(machine, seconds, finish)

    def _hand_over(self, job: _Job, source: _Machine) -> None:
        target = job.token_machine
        if target is source:
            delay = 0.0
        elif job.layerwise:
            delay = self.link.layerwise_overhead + serialized_transfer_time(
                self.profile, self.link, job.request.prompt_len) / self.profile.L
        else:
            delay = serialized_transfer_time(self.profile, self.link, job.request.prompt_len)

        def arrive() -> None:
            target.waiting.append(job)
            self._kick(target)

        self.loop.after(delay, arrive)

    def _admit(self, machine: _Machine) -> None:
        while machine.waiting and (
            machine.kv_used + machine.waiting[0].kv_tokens <= self.kv_capacity
        ):
            job = machine.waiting.popleft()
            machine.kv_used += job.kv_tokens
            machine.active.append(job)

    def _run_token_step(self, machine: _Machine) -> None:
        batch = list(machine.active)

        def finish() -> None:
            for job in batch:
                job.tokens.append(self.loop.now)
                if len(job.tokens) == job.request.output_len:
                    machine.active.remove(job)
                    machine.kv_used -= job.kv_tokens
                    machine.assigned_kv_tokens -= job.kv_tokens

        self._busy_for(machine, self.profile.t, finish)


def _mixed_load(machine: _Machine) -> float:
    return machine.queued_prompt_tokens + machine.assigned_kv_tokens


def _shortest(pool: list[_Machine], load) -> _Machine | None:
    return min(pool, key=load) if pool else None
