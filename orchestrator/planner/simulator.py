"""A discrete-event simulator of pipeline-parallel serving (DejaVu Appendix B).

Policies:
- ``colocated``: pipelines of depth d that run prompts and tokens (one
  pipeline of depth D is the baseline, several are baseline-DP);
- ``disaggregated``: a prompt pipeline of depth D_p streams each microbatch's KV
  to a token pipeline of depth D_t (both may be replicated).

The model, and where it is simplified:
- Requests are grouped into microbatches of ``batch`` in arrival order; a
  microbatch occupies its pipeline slot until its longest request is done
  (microbatch-level scheduling, as in DejaVu's modified FasterTransformer), so
  early stops leave holes that new prompts fill.
- A pipeline of depth d holds d microbatches; each stage serves passes FIFO. A
  prompt pass costs ``Y/d`` per stage with Y linear in the microbatch's prompt
  tokens; a token pass costs ``t/d`` whatever the context length or how many
  requests are left (token steps are memory-bound).
- With an engine profile (``cost``, the emulated engine's cost model) a prompt pass
  costs ``cost.prefill_s`` of the microbatch's prompt tokens and a token pass
  ``cost.decode_s`` at the requests still generating and their mean context, so
  the simulator, the planner (``dejavu plan --engine-profile``) and the emulated
  engine read one cost model.
- Disaggregated prompts pay the streaming factor m; the KV then waits in the
  token pool's host memory until a token slot frees (no transfer time beyond m,
  no memory limit on that wait).
- Deterministic: ties in the event heap break by insertion order; all
  randomness lives in the workload (seeded).
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.pipeline import check_prefill_chunk, prompt_slots
from orchestrator.planner.perf_model import Profile
from orchestrator.planner.workload import Request
from orchestrator.profiles.profile import EngineProfile


class EventLoop:
    """A heap of (time, sequence, action)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float] | np.ndarray) -> Percentiles:
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
        return cls(float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class SimResult:
    policy: str
    config: str
    machines: int
    requests: int
    makespan: float
    ttft: Percentiles
    tbt: Percentiles
    busy_machine_seconds: float

    @property
    def throughput(self) -> float:
        """Requests per second over the makespan."""
        return self.requests / self.makespan

    @property
    def machine_seconds(self) -> float:
        """Machines are held for the whole run."""
        return self.machines * self.makespan

    @property
    def utilization(self) -> float:
        return self.busy_machine_seconds / self.machine_seconds


@dataclass(frozen=True)
class RequestTimes:
    """When one request arrived, got its first token, and each later token."""

    request: Request
    first_token: float
    tokens: list[float]

    def tbts(self) -> list[float]:
        return list(np.diff([self.first_token, *self.tokens]))

    def stamps(self) -> list[float]:
        """[arrival, first token, token, ...], as the bench times a request."""
        return [self.request.arrival, self.first_token, *self.tokens]


def summarize(
    policy: str, config: str, machines: int, times: list[RequestTimes], busy: float
) -> SimResult:
    start = min(r.request.arrival for r in times)
    end = max(r.tokens[-1] if r.tokens else r.first_token for r in times)
    return SimResult(
        policy=policy,
        config=config,
        machines=machines,
        requests=len(times),
        makespan=end - start,
        ttft=Percentiles.of([r.first_token - r.request.arrival for r in times]),
        tbt=Percentiles.of(list(itertools.chain.from_iterable(r.tbts() for r in times))),
        busy_machine_seconds=busy,
    )


@dataclass(eq=False)
class Microbatch:
    requests: list[Request]
    steps: int  # token passes: its longest request's output_len
    prompt_tokens: int
    prompt_done: float = math.nan
    step_times: list[float] = field(default_factory=list)

    @property
    def ready(self) -> float:
        return max(r.arrival for r in self.requests)

    def request_times(self) -> list[RequestTimes]:
        return [
            RequestTimes(r, self.prompt_done, self.step_times[: r.output_len])
            for r in self.requests
        ]


def microbatches(requests: list[Request], batch: int) -> list[Microbatch]:
    if batch < 1:
        raise ValueError(f"microbatch size must be >= 1, got {batch}")
    ordered = sorted(requests, key=lambda r: (r.arrival, r.id))
    groups = [ordered[i : i + batch] for i in range(0, len(ordered), batch)]
    return [
        Microbatch(g, max(r.output_len for r in g), sum(r.prompt_len for r in g)) for g in groups
    ]


class Pipeline:
    """``depth`` stages serving passes FIFO; a pass is one microbatch through every stage."""

    def __init__(
        self, loop: EventLoop, depth: int, on_pass: Callable[[Pipeline, Any], None]
    ):
        self.loop, self.depth, self.on_pass = loop, depth, on_pass
        self.queues: list[deque[tuple[Any, float]]] = [deque() for _ in range(depth)]
        self.busy = [False] * depth
        self.in_flight = 0
        self.busy_seconds = 0.0

    @property
    def has_slot(self) -> bool:
        return self.in_flight < self.depth

    def submit(self, mb: Any, whole_model_time: float) -> None:
        """``mb``: a :class:`Microbatch`, or the serving simulator's step."""
        self.queues[0].append((mb, whole_model_time / self.depth))
        self._start(0)

    def _start(self, stage: int) -> None:
        if self.busy[stage] or not self.queues[stage]:
            return
        mb, duration = self.queues[stage].popleft()
        self.busy[stage] = True
        self.busy_seconds += duration
        self.loop.after(duration, lambda: self._finish(stage, mb, duration))

    def _finish(self, stage: int, mb: Any, duration: float) -> None:
        self.busy[stage] = False
        if stage + 1 < self.depth:
            self.queues[stage + 1].append((mb, duration))
            self._start(stage + 1)
        else:
            self.on_pass(self, mb)
        self._start(stage)


def _least_loaded(pipes: list[Pipeline]) -> Pipeline | None:
    free = [p for p in pipes if p.has_slot]
    return min(free, key=lambda p: p.in_flight) if free else None


class _Cluster:
    """Prompt pipelines feed token pipelines; colocated when they are the same pipelines."""

    def __init__(
        self, profile: Profile, prompt_depths: list[int], token_depths: list[int] | None,
        cost: EngineProfile | None = None,
    ):
        self.profile, self.cost, self.loop = profile, cost, EventLoop()
        self.colocated = token_depths is None
        self.prompt_pipes = [Pipeline(self.loop, d, self._prompt_or_token) for d in prompt_depths]
        self.token_pipes = (
            self.prompt_pipes if token_depths is None
            else [Pipeline(self.loop, d, self._token_pass) for d in token_depths]
        )
        self.prompt_factor = 1.0 if self.colocated else profile.m
        self.waiting: deque[Microbatch] = deque()
        self.streamed: deque[Microbatch] = deque()  # prompt done, waiting for a token slot
        self.done: list[Microbatch] = []

    def run(self, mbs: list[Microbatch]) -> list[Microbatch]:
        for mb in mbs:
            self.loop.at(mb.ready, lambda mb=mb: (self.waiting.append(mb), self._dispatch()))
        self.loop.run()
        if len(self.done) != len(mbs):
            raise RuntimeError(f"simulation ended with {len(mbs) - len(self.done)} unfinished")
        return self.done

    def busy_seconds(self) -> float:
        pipes = {id(p): p for p in self.prompt_pipes + self.token_pipes}.values()
        return sum(p.busy_seconds for p in pipes)

    def _dispatch(self) -> None:
        while self.streamed and (pipe := _least_loaded(self.token_pipes)):
            pipe.in_flight += 1
            mb = self.streamed.popleft()
            pipe.submit(mb, self._step_time(mb))
        while self.waiting and (pipe := _least_loaded(self.prompt_pipes)):
            mb = self.waiting.popleft()
            pipe.in_flight += 1
            pipe.submit(mb, self.prompt_factor * self._prompt_time(mb))

    def _prompt_time(self, mb: Microbatch) -> float:
        if self.cost is None:
            return self.profile.prompt_time_per_token * mb.prompt_tokens
        return self.cost.prefill_s(mb.prompt_tokens)

    def _step_time(self, mb: Microbatch) -> float:
        """The microbatch's next token pass: its live requests at their mean context."""
        if self.cost is None:
            return self.profile.t
        done = len(mb.step_times)
        live = [r for r in mb.requests if r.output_len > done]
        return self.cost.decode_s(len(live), statistics.fmean(r.prompt_len + done for r in live))

    def _prompt_or_token(self, pipe: Pipeline, mb: Microbatch) -> None:
        if not math.isnan(mb.prompt_done):
            self._token_pass(pipe, mb)
            return
        mb.prompt_done = self.loop.now
        if self.colocated:
            pipe.submit(mb, self._step_time(mb))
        else:
            pipe.in_flight -= 1
            self.streamed.append(mb)
            self._dispatch()

    def _token_pass(self, pipe: Pipeline, mb: Microbatch) -> None:
        mb.step_times.append(self.loop.now)
        if len(mb.step_times) < mb.steps:
            pipe.submit(mb, self._step_time(mb))
            return
        pipe.in_flight -= 1
        self.done.append(mb)
        self._dispatch()


def simulate_colocated(
    profile: Profile, requests: list[Request], depth: int, pipelines: int = 1,
    batch: int | None = None, cost: EngineProfile | None = None,
) -> SimResult:
    """``pipelines`` colocated pipelines of ``depth`` machines each (``cost``: step times
    from this engine profile instead of the profile's Y and t)."""
    if depth < 1 or pipelines < 1:
        raise ValueError(f"need depth >= 1 and pipelines >= 1, got {depth}, {pipelines}")
    cluster = _Cluster(profile, [depth] * pipelines, None, cost)
    done = cluster.run(microbatches(requests, batch or profile.workload.batch))
    policy = "colocated" if pipelines == 1 else "colocated-dp"
    return summarize(policy, f"{pipelines}x depth {depth}", depth * pipelines,
                     [t for mb in done for t in mb.request_times()], cluster.busy_seconds())


def simulate_disaggregated(
    profile: Profile, requests: list[Request], prompt_depth: int, token_depth: int,
    replicas: int = 1, batch: int | None = None, cost: EngineProfile | None = None,
) -> SimResult:
    """``replicas`` x (prompt pipeline of ``prompt_depth`` + token pipeline of ``token_depth``)."""
    if prompt_depth < 1 or token_depth < 1 or replicas < 1:
        raise ValueError(
            f"need depths and replicas >= 1, got {prompt_depth}, {token_depth}, {replicas}"
        )
    cluster = _Cluster(profile, [prompt_depth] * replicas, [token_depth] * replicas, cost)
    done = cluster.run(microbatches(requests, batch or profile.workload.batch))
    return summarize("disaggregated", f"{replicas}x (P{prompt_depth}+T{token_depth})",
                     (prompt_depth + token_depth) * replicas,
                     [t for mb in done for t in mb.request_times()], cluster.busy_seconds())


# -- the serving system, as it schedules ---------------------------------------------------


@dataclass(eq=False)
class _Seq:
    request: Request
    pipe: _TokenPipe
    generated: int = 0  # tokens made so far, the first included
    prefilled: int = 0  # colocated: prompt tokens scheduled so far (chunked prefill)
    first_token: float = math.nan
    tokens: list[float] = field(default_factory=list)  # times of the tokens after the first

    @property
    def context(self) -> int:
        """What the emulated engine's step reads: the mean KV length + 1."""
        return self.request.prompt_len + self.generated


class _TokenPipe:
    """A token pipeline as :class:`~orchestrator.pipeline.head.PipelineHead` runs it: ``depth``
    microbatches of up to ``slots`` sequences, refilled from one waiting queue at each
    microbatch's step; colocated, joining prompts are prefilled in that step with the
    others' token step (with ``prefill_chunk``, as chunks within that step budget, started
    prompts first: :class:`~orchestrator.pipeline.scheduler.MicrobatchScheduler`), timed
    as one mixed step (the profile's ``mixed_s``); every stage serves steps FIFO at
    1/depth of the whole-model time."""

    def __init__(self, sim: ServingSimulator, depth: int) -> None:
        self.sim, self.depth = sim, depth
        self.stages = Pipeline(sim.loop, depth, self._returned)
        self.running: list[list[_Seq]] = [[] for _ in range(depth)]
        self.in_flight = [False] * depth
        self.waiting: deque[_Seq] = deque()
        self.pending_tokens = 0  # the frontend's router: tokens still to prefill, generate here

    def issue_idle(self) -> None:
        for mb in range(self.depth):
            if not self.in_flight[mb]:
                self._issue(mb)

    def _issue(self, mb: int) -> None:
        running, new = self.running[mb], []
        if not self.sim.colocated:
            while self.waiting and len(running) + len(new) < self.sim.slots:
                new.append(self.waiting.popleft())
            chunks, decode = [], running + new
        else:
            decode = [s for s in running if s.prefilled == s.request.prompt_len]
            budget = self.sim.prefill_chunk - len(decode) if self.sim.prefill_chunk else None
            prefilling = [s for s in running if s.prefilled < s.request.prompt_len]
            chunks = []
            while budget is None or budget > 0:
                if prefilling:
                    seq = prefilling.pop(0)
                elif self.waiting and len(running) + len(new) < self.sim.slots:
                    seq = self.waiting.popleft()
                    new.append(seq)
                    seq.prefilled = self.sim.cached_tokens(seq.request.prompt_len)
                else:
                    break
                n = seq.request.prompt_len - seq.prefilled
                n = n if budget is None else min(n, budget)
                chunks.append((seq, seq.prefilled, n))
                seq.prefilled += n
                budget = None if budget is None else budget - n
        if not chunks and not decode:
            return
        context = statistics.fmean(s.context for s in decode) if decode else 0.0
        seconds = self.sim.step_overhead_s + self.sim.cost.mixed_s(
            sum(n for _, _, n in chunks), sum(c for _, c, _ in chunks), len(decode), context)
        self.running[mb] = running + new
        self.in_flight[mb] = True
        prompts = [seq for seq, _, _ in chunks if seq.prefilled == seq.request.prompt_len]
        self.stages.submit(_Step(mb, prompts, decode), seconds)

    def _returned(self, _pipe: Pipeline, step: _Step) -> None:
        now = self.sim.loop.now
        for seq in step.prefill:
            seq.first_token, seq.generated = now, 1
            self.pending_tokens -= seq.request.prompt_len
        for seq in step.decode:
            seq.tokens.append(now)
            seq.generated += 1
        for seq in step.prefill + step.decode:
            self.pending_tokens -= 1
            if seq.generated >= seq.request.output_len:
                self.running[step.microbatch].remove(seq)
                self.sim.finished(seq)
        self.in_flight[step.microbatch] = False
        self._issue(step.microbatch)


@dataclass(eq=False)
class _Step:
    microbatch: int
    prefill: list[_Seq]
    decode: list[_Seq]


class _PromptNode:
    """A P-node: one streamed prefill at a time, FIFO (Triton gives its model one request
    per call; its stages run in turn in one process)."""

    def __init__(self, sim: ServingSimulator) -> None:
        self.sim = sim
        self.queue: deque[_Seq] = deque()
        self.queued_tokens = 0
        self.busy = False
        self.busy_seconds = 0.0

    def add(self, seq: _Seq) -> None:
        self.queue.append(seq)
        self.queued_tokens += seq.request.prompt_len
        self._next()

    def _next(self) -> None:
        if self.busy or not self.queue:
            return
        seq = self.queue.popleft()
        seconds = self.sim.step_overhead_s + self.sim.m * self.sim.prompt_cost.reused_prefill_s(
            seq.request.prompt_len, self.sim.hit_rate)
        self.busy, self.busy_seconds = True, self.busy_seconds + seconds

        def done() -> None:
            self.busy = False
            self.queued_tokens -= seq.request.prompt_len
            seq.first_token, seq.generated = self.sim.loop.now, 1
            seq.pipe.pending_tokens -= 1
            if seq.generated >= seq.request.output_len:
                self.sim.finished(seq)
            else:
                seq.pipe.waiting.append(seq)
                seq.pipe.issue_idle()
            self._next()

        self.sim.loop.after(seconds, done)


class ServingSimulator:
    """The serving system at request level, timed by an engine profile: the frontend's
    shortest-queue routers (pending tokens), its seats (each token pipeline holds
    depth x batch sequences and ``slots`` waiting ones, by default as the cluster sizes
    them: :func:`~orchestrator.pipeline.prompt_slots`), P-nodes and token
    pipelines as above. ``colocated``: ``token_pipelines`` colocated pipelines, no
    P-nodes; ``prefill_chunk``: their step budget (chunked prefill; 0: whole prompts).
    The same scheduling :mod:`~orchestrator.planner.capacity` models in closed form."""

    def __init__(self, cost: EngineProfile, batch: int, prompt_nodes: int, token_pipelines: int,
                 token_depth: int, m: float = 1.0, slots: int | None = None,
                 prompt_cost: EngineProfile | None = None, hit_rate: float = 0.0,
                 prefill_chunk: int = 0, step_overhead_s: float = 0.0,
                 dispatch_s: float = 0.0) -> None:
        """``hit_rate``: the prompt tokens the prefilling nodes' prefix caches hold (the
        trace's, or measured): each prompt computes only the rest; ``prefill_chunk``:
        colocated, a step's token budget (0: whole prompts); ``step_overhead_s``: the
        serving path's own time per engine call (a token pipeline's step, a P-node's
        prefill), outside the engine's profiled time: the head scheduling the step and its
        gRPC calls, the token's relay. Near saturation the TTFT tail hangs on it: a 1.3%
        longer step took the simulated share of requests past a 1 s TTFT from 7% to 11%
        (0.88x a colocated layout's capacity; docs/planner.md). ``dispatch_s``:
        disaggregated, a request's time on the serving path's hops to its first token
        outside the P-node's queue and prefill: the frontend's T-node admission (the KV
        ticket its prompt needs, a round trip before the prompt goes out) and the P-node
        call's way there and back; a request joins a P-node's queue that long after its
        seat (``dejavu bench disagg --trace mooncake`` measures it: docs/bench-kv-reuse.md)."""
        if batch < 1 or token_pipelines < 1 or token_depth < 1 or prompt_nodes < 0 or m < 1:
            raise ValueError("need batch, token pipelines and depth >= 1, P-nodes >= 0, m >= 1")
        if not 0 <= hit_rate <= 1:
            raise ValueError(f"a hit rate is in [0, 1], got {hit_rate}")
        if step_overhead_s < 0 or dispatch_s < 0:
            raise ValueError(f"a step's overhead and a dispatch are >= 0 s, got "
                             f"{step_overhead_s}, {dispatch_s}")
        if dispatch_s and not prompt_nodes:
            raise ValueError("dispatch_s is the way to a P-node: no P-nodes, colocated")
        if prefill_chunk and prompt_nodes:
            raise ValueError("prefill_chunk chunks colocated prompts: no P-nodes")
        check_prefill_chunk(prefill_chunk, batch)
        self.cost, self.slots, self.m, self.hit_rate = cost, batch, m, hit_rate
        self.prefill_chunk, self.step_overhead_s = prefill_chunk, step_overhead_s
        self.dispatch_s = dispatch_s
        self.prompt_cost = prompt_cost or cost  # P-nodes of another machine: their own
        self.colocated = prompt_nodes == 0
        self.loop = EventLoop()
        self.pipes = [_TokenPipe(self, token_depth) for _ in range(token_pipelines)]
        self.prompt_nodes = [_PromptNode(self) for _ in range(prompt_nodes)]
        slots = prompt_slots(prompt_nodes, token_pipelines) if slots is None else slots
        self.seats = token_pipelines * (token_depth * batch + slots)
        self.queue: deque[Request] = deque()  # waiting for a seat at the frontend
        self.done: list[_Seq] = []

    def cached_tokens(self, prompt_len: int) -> int:
        """A prompt's tokens the prefix cache holds, at the hit rate (one computed at least)."""
        return min(prompt_len - 1, round(prompt_len * self.hit_rate))

    def run(self, requests: list[Request]) -> list[RequestTimes]:
        for r in requests:
            self.loop.at(r.arrival, lambda r=r: (self.queue.append(r), self._seat()))
        self.loop.run()
        if len(self.done) != len(requests):
            raise RuntimeError(f"simulation ended with {len(requests) - len(self.done)} "
                               "unfinished")
        return [RequestTimes(s.request, s.first_token, s.tokens)
                for s in sorted(self.done, key=lambda s: s.request.id)]

    def finished(self, seq: _Seq) -> None:
        self.done.append(seq)
        self.seats += 1
        self._seat()

    def _seat(self) -> None:
        while self.queue and self.seats > 0:
            self.seats -= 1
            request = self.queue.popleft()
            pipe = min(self.pipes, key=lambda p: p.pending_tokens)
            # Colocated, the prompt's tokens count until its prefill (the frontend's rule).
            pipe.pending_tokens += request.output_len + (request.prompt_len if self.colocated
                                                         else 0)
            seq = _Seq(request, pipe)
            if self.colocated:
                pipe.waiting.append(seq)
                pipe.issue_idle()
            elif self.dispatch_s:
                self.loop.after(self.dispatch_s, lambda seq=seq: self._to_prompt_node(seq))
            else:
                self._to_prompt_node(seq)

    def _to_prompt_node(self, seq: _Seq) -> None:
        """The P-node with the fewest queued prompt tokens when the prompt gets there (the
        frontend picks it once the T-node admitted the request)."""
        min(self.prompt_nodes, key=lambda n: n.queued_tokens).add(seq)
