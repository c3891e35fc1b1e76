"""The token pipeline in one process: a head and D stage workers, microbatches in flight.

``TokenPipeline`` is a :class:`~orchestrator.pipeline.head.PipelineHead` whose
stages are threads beside it, linked by in-process queues (or any ``make_link``).
A depth-1 pipeline is one T-node; across processes the same head and the same
:class:`~orchestrator.pipeline.stage.StageWorker` run split over
:class:`~orchestrator.pipeline.node.StageNode` s. ``mode="colocated"`` is the
baseline: prompts enter the same pipeline and run inside microbatch steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from orchestrator.engine.base import Engine
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.torch_engine import TorchEngine, load_engine
from orchestrator.layout import StageSpec
from orchestrator.pipeline import SwapMode
from orchestrator.pipeline.head import PipelineHead
from orchestrator.pipeline.link import Link, QueueLink
from orchestrator.pipeline.prompt_worker import PromptKVStore, PromptWorker
from orchestrator.pipeline.sequence import Sequence as Seq
from orchestrator.pipeline.stage import Interval, PromptKVSource, StageWorker
from orchestrator.pipeline.swapper import (
    DeviceArena,
    KVPlacement,
    ResidentKV,
    SwappedKV,
    measure_copy_bandwidth,
    should_swap,
)


def stage_specs(
    num_layers: int, depth: int | None = None, layers: Sequence[int] | None = None
) -> list[StageSpec]:
    """An even split into ``depth`` stages, or explicit layer counts per stage."""
    if layers is None:
        return StageSpec.split(num_layers, depth or 1)
    if depth is not None and depth != len(layers):
        raise ValueError(f"depth {depth} but {len(layers)} layer counts {list(layers)}")
    if sum(layers) != num_layers or min(layers) < 1:
        raise ValueError(f"layer counts {list(layers)} do not split {num_layers} layers")
    bounds = [0, *torch.tensor(list(layers)).cumsum(0).tolist()]
    return [StageSpec(a, b, num_layers) for a, b in zip(bounds, bounds[1:], strict=False)]


def load_pipeline_engines(
    model_dir: str | Path,
    depth: int | None = None,
    layers: Sequence[int] | None = None,
    **engine_kwargs,
) -> list[TorchEngine]:
    """One engine per stage of :func:`stage_specs` (``engine_kwargs`` go to ``load_engine``)."""
    num_layers = ModelConfig.from_dir(model_dir).num_layers
    return [load_engine(model_dir, spec, **engine_kwargs)
            for spec in stage_specs(num_layers, depth, layers)]


class TokenPipeline(PipelineHead):
    """A head and all its stages in this process, one thread each, linked by ``make_link``."""

    def __init__(
        self,
        engines: Sequence[Engine],
        batch_size: int,
        *,
        mode: str = "disaggregated",
        num_microbatches: int | None = None,
        swap: str = "off",
        device_kv_budget: int | None = None,
        swap_workload: tuple[int, int] | None = None,
        prompt_engines: Sequence[Engine] | None = None,
        prompt_kv: PromptKVSource | None = None,
        prompt_batch: int = 4,
        step_timeout_s: float = 60.0,
        poll_s: float = 0.005,
        make_link: Callable[[str, int], Link] = QueueLink,
    ) -> None:
        """``device_kv_budget``: device KV bytes per stage (default: just what the mode needs).
        ``swap_workload``: (prompt_len, new_tokens) the ``auto`` swap rule is evaluated for.
        ``prompt_engines``: an in-process P-worker's stages (disaggregated); without them,
        prompt KV arrives from elsewhere through ``prompt_kv`` and ``submit_prefilled``.
        ``make_link(name, capacity)``: the stage-to-stage links (default in-process queues)."""
        _check_chain(engines)
        self.engines, self.depth = list(engines), len(engines)
        num_microbatches = num_microbatches or self.depth
        capacity = link_capacity(num_microbatches)
        self.links = [make_link(f"link-{i}", capacity) for i in range(self.depth + 1)]
        super().__init__(
            self.links[0], self.links[-1], num_microbatches=num_microbatches,
            batch_size=batch_size, max_seq_len=min(e.kv_layout.max_seq_len for e in engines),
            mode=mode, step_timeout_s=step_timeout_s, poll_s=poll_s,
        )
        self.swap = resolve_swap(self.engines, swap, device_kv_budget, swap_workload,
                                 num_microbatches, batch_size)
        self.kv = [make_placement(engine, batch_size, num_microbatches, self.swap,
                                  device_kv_budget) for engine in engines]

        self.prompt_store = PromptKVStore()
        self.prompt_kv: PromptKVSource = prompt_kv or self.prompt_store
        self.prompt_worker: PromptWorker | None = None
        if prompt_engines is not None:
            if prompt_kv is not None:
                raise ValueError("give prompt_engines (in-process P-worker) or prompt_kv, not both")
            if mode == "colocated":
                raise ValueError("colocated pipelines run their own prompts; drop prompt_engines")
            _check_chain(prompt_engines)
            self.prompt_worker = PromptWorker(
                prompt_engines, [e.kv_layout for e in engines], self.prompt_store,
                self._admit_prefilled, prompt_batch,
            )
        self.device_kv_budget = device_kv_budget
        self.stages = [self._make_stage(i) for i in range(self.depth)]

    def _make_stage(self, index: int) -> StageWorker:
        return StageWorker(index, self.engines[index], self.kv[index], self.links[index],
                           self.links[index + 1], self.num_microbatches, self.prompt_kv,
                           send_timeout_s=self.step_timeout_s, report=self.report_failure)

    def replace_stage(self, index: int) -> StageWorker:
        """Fault recovery: a fresh worker for stage ``index`` on the same engine (a hot spare
        with the weights loaded) and links, with empty KV and the old one's hooks; not
        started. The old worker's thread must have ended."""
        old = self.stages[index]
        if old.thread.is_alive():
            raise RuntimeError(f"stage {index} is still running; it cannot be replaced")
        old.kv.shutdown()
        self.kv[index] = make_placement(self.engines[index], self.batch_size,
                                        self.num_microbatches, self.swap, self.device_kv_budget)
        self.stages[index] = new = self._make_stage(index)
        new.on_step, new.on_release = old.on_step, old.on_release
        return new

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> TokenPipeline:
        for stage in self.stages:
            stage.start()
        if self.prompt_worker is not None:
            self.prompt_worker.start()
        super().start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the P-worker, the head, then every stage in order."""
        if not self._started:
            return
        if self.prompt_worker is not None:
            self.prompt_worker.stop(timeout_s)
        deadline = time.monotonic() + timeout_s
        super().stop(timeout_s)
        for stage in self.stages:
            stage.thread.join(max(0.0, deadline - time.monotonic()))

    # -- requests ---------------------------------------------------------------------

    def submit(self, seq: Seq) -> Seq:
        """A new request: colocated, queued as a prompt; disaggregated, to the P-worker."""
        if self.prompt_worker is None:
            return super().submit(seq)
        with self._lock:
            self._register(seq)
            self.prompt_worker.submit(seq)
        return seq

    def _cancel_elsewhere(self, request_id: str) -> None:
        if self.prompt_worker is not None:
            self.prompt_worker.cancel(request_id)

    def _restart(self, seq: Seq) -> None:
        """With its own P-worker, a sequence whose prompt KV was lost is prefilled again."""
        if self.prompt_worker is None:
            super()._restart(seq)
        else:
            self.prompt_worker.submit(seq)

    def _discard_prompt_kv(self, seq: Seq) -> None:
        if self.prompt_kv is self.prompt_store:
            self.prompt_store.discard(seq.seq_id)
        else:
            super()._discard_prompt_kv(seq)

    def _stall_hint(self) -> str:
        return f" (stage threads alive: {[s.thread.is_alive() for s in self.stages]})"

    # -- what benchmarks and tests read ---------------------------------------------------

    @property
    def timelines(self) -> list[list[Interval]]:
        return [stage.timeline for stage in self.stages]

    @property
    def arenas(self) -> list[DeviceArena]:
        return [kv.arena for kv in self.kv]

    def kv_held(self) -> int:
        """Sequences whose KV any stage or the prompt store still holds."""
        return sum(len(kv) for kv in self.kv) + len(self.prompt_store)


def link_capacity(num_microbatches: int) -> int:
    """Messages a link may hold: every microbatch's step, one KV probe and the shutdown."""
    return num_microbatches + 2


def make_placement(
    engine: Engine, batch_size: int, num_microbatches: int, swap: bool, budget: int | None
) -> KVPlacement:
    """A stage's KV placement: swapping needs 2 microbatches on the device, resident all."""
    layout = engine.kv_layout
    slots = batch_size * (2 if swap else num_microbatches)
    budget = budget or slots * layout.slot_bytes()
    arena = DeviceArena(layout, budget, engine.device)
    if arena.capacity < slots:
        raise ValueError(
            f"stage {engine.stage}: {'swapping' if swap else 'resident'} KV for "
            f"batch {batch_size} x {num_microbatches} microbatches needs {slots} "
            f"slots of {layout.slot_bytes()} B; the budget {budget} B holds "
            f"{arena.capacity}" + ("" if swap else "; lower batch_size or swap")
        )
    return SwappedKV(arena) if swap else ResidentKV(arena)


def resolve_swap(
    engines: Sequence[Engine],
    swap: str,
    budget: int | None,
    workload: tuple[int, int] | None,
    num_microbatches: int,
    batch_size: int,
) -> bool:
    """``auto``: keep KV resident when it fits the budget, else apply the Appendix E rule
    with the step time and copy bandwidth measured on this machine (for ``engines``:
    one stage node decides for its own stage)."""
    if swap not in tuple(SwapMode):
        raise ValueError(f"swap must be one of {', '.join(SwapMode)}, got {swap!r}")
    if swap != SwapMode.AUTO:
        return swap == SwapMode.ON
    resident_slots = num_microbatches * batch_size
    if budget is None or all(budget >= resident_slots * e.kv_layout.slot_bytes()
                             for e in engines):
        return False
    if workload is None:
        raise ValueError("swap='auto' over budget needs swap_workload=(prompt_len, new_tokens)")
    prompt_len, new_tokens = workload
    bandwidth = measure_copy_bandwidth(engines[0].device)
    for engine in engines:
        resident_batch = budget // engine.kv_layout.slot_bytes() // num_microbatches
        if resident_batch == 0:
            return True  # nothing fits without swapping
        step_time = measure_step_time(engine, resident_batch, prompt_len)
        token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
        if not should_swap(new_tokens, step_time, prompt_len, resident_batch, token_bytes,
                           bandwidth):
            return False
    return True


def measure_step_time(engine: Engine, batch_size: int, context_len: int, repeats: int = 3) -> float:
    """One decode step of ``batch_size`` sequences at ``context_len`` on this stage (seconds)."""
    caches = [engine.new_cache() for _ in range(batch_size)]
    best = float("inf")
    for _ in range(repeats):
        for cache in caches:
            cache.length = min(context_len, cache.layout.max_seq_len - 1)
        if engine.stage.is_first:
            inputs = torch.zeros(batch_size, dtype=torch.long)
        else:
            inputs = torch.zeros(batch_size, engine.hidden_size, device=engine.device)
        start = time.perf_counter()
        engine.decode(inputs, caches)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        best = min(best, time.perf_counter() - start)
    return best


def _check_chain(engines: Sequence[Engine]) -> None:
    """The engines must cover the model's layers in order, first to last."""
    if not engines:
        raise ValueError("no engines")
    stages = [e.stage for e in engines]
    if not stages[0].is_first or not stages[-1].is_last or any(
        a.last_layer != b.first_layer for a, b in zip(stages, stages[1:], strict=False)
    ):
        raise ValueError(f"engines do not chain the model's layers in order: {stages}")
