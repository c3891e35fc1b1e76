"""What every stage of a token pipeline is built from: its link capacity, its KV placement.

A pipeline's stages are :class:`~orchestrator.pipeline.node.StageNode` s, one
per T-node, or all in one process
(:class:`~orchestrator.pipeline.local.LocalPipeline`); each holds the layers
:meth:`~orchestrator.layout.StageSpec.split` gives it and decides here whether
its KV swaps (:func:`resolve_swap`, DejaVu Appendix E) and where it lives
(:func:`make_placement`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from orchestrator.engine.base import Engine
from orchestrator.pipeline import SwapMode
from orchestrator.pipeline.swapper import (
    DeviceArena,
    KVPlacement,
    ResidentKV,
    SwappedKV,
    measure_copy_bandwidth,
    should_swap,
)


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


def check_chain(engines: Sequence[Engine]) -> None:
    """The engines must cover the model's layers in order, first to last."""
    if not engines:
        raise ValueError("no engines")
    stages = [e.stage for e in engines]
    if not stages[0].is_first or not stages[-1].is_last or any(
        a.last_layer != b.first_layer for a, b in zip(stages, stages[1:], strict=False)
    ):
        raise ValueError(f"engines do not chain the model's layers in order: {stages}")
