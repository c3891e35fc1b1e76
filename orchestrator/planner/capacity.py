"""The capacity model: sustained requests/s of a layout, from the engine profile the
emulated engine sleeps on, scheduled as the serving system schedules.

It predicts; :mod:`orchestrator.planner.planner` decides. What it models, from the
serving code:

- A token pipeline of depth d runs d microbatches of up to ``batch`` sequences
  (:class:`~orchestrator.pipeline.scheduler.MicrobatchScheduler`); a freed slot is
  refilled at that microbatch's next step, so at saturation every slot is busy. A
  token machine's throughput is its running batch over the step at that batch and
  context, not one microbatch per step time: on a CPU the step grows about linearly
  with the batch, on a GPU hardly.
- Colocated, a new sequence's prompt runs in its microbatch's step with the
  others' token step (``Engine.step``): that step is Sarathi's mixed step (the
  prefill plus the token steps' increment over a pass's fixed cost), and
  the sequence holds its slot for n steps (the prefill makes its first token).
  At saturation B/n sequences join each step, their prompts prefilled in one pass.
  In a pipeline a step with a prompt stalls the others behind it: the first such
  step of a round costs its whole prefill, later ones of the same round overlap
  in the pipeline (1/d each).
- Disaggregated, the P-node makes the first token and a sequence holds its T slot
  for n - 1 token steps. A P-node prefills one request at a time (Triton hands its
  model one request per call; its D_p stages run in turn in one process), so its
  rate is 1 / (m x mean prefill) whatever its depth.
- KV memory: a machine holds ``kv_memory_bytes`` of KV, so a microbatch runs at
  most as many sequences as fit at their mean length (the profile's, scaled by the
  run's KV factor where the emulated engine holds less).
- Pools: any P-node feeds any token pipeline (the frontend routes each pool by
  shortest queue), so a disaggregated layout serves min(prompt rate, token rate).

- A shared host (the torch engine on CPU cores): the serving path's own CPU (Triton,
  gRPC, the frontend relaying every token, NIXL's threads) runs on the cores the engines
  compute on, and slows them (:func:`shared_host_slowdown`). On a GPU, or the emulated
  engine (its steps sleep), it takes no engine time and is not modelled.

Not modelled: KV transfer time beyond m, and queueing before saturation.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.profiles.profile import EngineProfile


def overlap_cost(depth: int) -> float:
    """The share of a prompt pass's time that a pipeline of ``depth`` loses when another
    pass already stalls it in the same round. Fitted to the event-driven simulator
    (:class:`~orchestrator.planner.simulator.ServingSimulator`, H100 Llama-2-70B, Azure
    code trace, batch 4 and 16, depth 2-8: 0.77, 0.62, 0.49, 0.40, 0.37 at depth 2, 3, 4,
    6, 8); DejaVu's bubble argument gives 1 at depth 1 and less as passes spread. Its
    offset went from 0.15 to 0.10 when a colocated step became one mixed step (Sarathi's
    model): the simulator's depth-4 pipelines then ran 10.2% and 10.5% above the model
    (conversation, code), within 10% after."""
    return min(1.0, 0.10 + 1.5 / depth)


def shared_host_slowdown(rps: float, tokens_per_request: float, serving_s_per_token: float,
                         cores: float) -> float:
    """How much slower engines compute where the serving path shares their ``cores``, at
    the capacity this slowdown leaves: each token costs the serving path
    ``serving_s_per_token`` of CPU, so at rate r it takes u = r x tokens x sigma / cores of
    every core and the engines run 1 / (1 - u) slower. A layout that serves ``rps`` with
    the cores to itself then serves rps / s, where s = 1 + rps x tokens x sigma / cores
    (solving r = rps x (1 - u(r))): its profile slowed s times."""
    if serving_s_per_token < 0 or cores <= 0:
        raise ValueError(f"need serving CPU >= 0 and cores > 0; got {serving_s_per_token}, "
                         f"{cores}")
    return 1.0 + rps * tokens_per_request * serving_s_per_token / cores


@dataclass(frozen=True)
class Demand:
    """The workload as the model sees it: means over the requests' (prompt, output) lengths.

    ``output`` counts every token a request streams, the first included."""

    prompt: float  # mean prompt tokens
    output: float  # mean tokens generated
    context: float  # mean context of a token step, weighted by the steps each request takes
    prefill_s: float  # mean prefill of one prompt alone (s)

    @classmethod
    def of(cls, lengths: Sequence[tuple[int, int]], cost: EngineProfile,
           hit_rate: float = 0.0) -> Demand:
        """``hit_rate``: the share of prompt tokens a prefix cache holds (the trace's, or
        measured): each prompt computes only the rest."""
        if not lengths or min(min(p, n) for p, n in lengths) < 1:
            raise ValueError("need at least one request, each with a prompt and an output")
        # A request of n tokens takes n - 1 token steps, at contexts p+1 .. p+n-1 (the
        # emulated engine's mean KV length + 1): weight each request by its steps.
        steps = sum(n - 1 for _, n in lengths)
        context = (sum((n - 1) * (p + n / 2) for p, n in lengths) / steps if steps
                   else statistics.fmean(p for p, _ in lengths) + 1)
        return cls(prompt=statistics.fmean(p for p, _ in lengths),
                   output=statistics.fmean(n for _, n in lengths),
                   context=context,
                   prefill_s=statistics.fmean(cost.reused_prefill_s(p, hit_rate)
                                              for p, _ in lengths))


@dataclass(frozen=True)
class Capacity:
    """Requests/s of each kind of node for one workload on one engine profile."""

    cost: EngineProfile
    demand: Demand
    batch: int  # sequences per microbatch (``--max-batch``)
    m: float = 1.0  # a streamed prefill over a plain one (KV sent layer by layer)
    kv_scale: float = 1.0  # KV bytes the run holds per token over the profile's
    prompt_s: float | None = None  # a P-node's mean prefill, where it is another machine

    def __post_init__(self) -> None:
        if self.batch < 1 or self.m < 1 or self.kv_scale <= 0:
            raise ValueError(f"need batch >= 1, m >= 1, kv_scale > 0; got {self.batch}, "
                             f"{self.m}, {self.kv_scale}")

    @classmethod
    def of(cls, lengths: Sequence[tuple[int, int]], cost: EngineProfile, batch: int,
           m: float = 1.0, kv_scale: float = 1.0,
           prompt_cost: EngineProfile | None = None, hit_rate: float = 0.0) -> Capacity:
        """``prompt_cost``: the P-nodes' profile where they are other machines (Splitwise's
        mixed pools); ``cost`` times every other node; ``hit_rate``: the prompt tokens
        the nodes' prefix caches hold (:meth:`Demand.of`)."""
        prompt_s = (None if prompt_cost is None
                    else Demand.of(lengths, prompt_cost, hit_rate).prefill_s)
        return cls(cost, Demand.of(lengths, cost, hit_rate), batch, m, kv_scale, prompt_s)

    @property
    def slots(self) -> int:
        """Sequences a microbatch runs: ``batch``, or fewer where one machine's KV memory
        cannot hold them at their mean length."""
        per_sequence = (self.demand.prompt + self.demand.output) * self.cost.kv_bytes_per_token
        fits = int(self.cost.kv_memory_bytes / (per_sequence * self.kv_scale))
        return max(1, min(self.batch, fits))

    def decode_s(self, batch: float) -> float:
        """A whole-model token step of ``batch`` sequences (a mean: interpolated between
        whole batches) at the workload's context."""
        return self.cost.decode_s(max(1.0, batch), self.demand.context)

    def prefill_pass_s(self, prompts: float) -> float:
        """One prefill pass of ``prompts`` prompts batched: the mean single prefill (the
        profile is not linear in tokens), scaled as the profile scales to their tokens."""
        if prompts <= 1:
            return self.demand.prefill_s
        one = self.cost.prefill_s(max(1, round(self.demand.prompt)))
        many = self.cost.prefill_s(max(1, round(prompts * self.demand.prompt)))
        return self.demand.prefill_s * many / one

    def prompt_rps(self) -> float:
        """One P-node, any depth: one streamed prefill at a time."""
        return 1.0 / (self.m * (self.prompt_s or self.demand.prefill_s))

    def token_rps(self, depth: int) -> float:
        """One token pipeline of ``depth`` fed by P-nodes: ``depth`` microbatches of full
        slots, each step one decode of the whole batch, n - 1 steps a request."""
        b, steps = self.slots, max(1.0, self.demand.output - 1)
        return depth * b / (steps * self.decode_s(b))

    def colocated_step_s(self, depth: int) -> float:
        """A round of a colocated pipeline at saturation: every microbatch's token step
        and the prompts that joined it."""
        b, n = self.slots, self.demand.output
        joins = b / n  # sequences joining a microbatch per step (each holds n steps)
        with_prompt = min(1.0, joins)  # steps that run a prefill pass
        prefill = self.prefill_pass_s(max(1.0, joins))
        # A prompt pass stalls the microbatches behind it in every stage: the round's
        # first costs all of it, the others partly overlap with it.
        first = (1 - (1 - with_prompt) ** depth) * prefill
        rest = depth * with_prompt * prefill - first
        # A step with a prompt pass is one mixed step (the profile's ``mixed_s``): its token
        # steps add only their increment over a pass's fixed cost, which the prompt pays.
        token = self.decode_s(b - joins)
        fixed = token - self.cost.decode_increment_s(max(1.0, b - joins), self.demand.context)
        return token - with_prompt * fixed + first + rest * overlap_cost(depth)

    def colocated_rps(self, depth: int) -> float:
        """One colocated pipeline of ``depth``: prompts run in its microbatch steps."""
        return depth * self.slots / (self.demand.output * self.colocated_step_s(depth))

    def disaggregated_rps(self, prompt_nodes: int, token_pipelines: int,
                          token_depth: int) -> float:
        """P-nodes feeding token pipelines through the frontend's routers."""
        return min(prompt_nodes * self.prompt_rps(),
                   token_pipelines * self.token_rps(token_depth))
