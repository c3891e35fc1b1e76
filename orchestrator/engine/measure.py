"""``dejavu profile``: measure an engine on its device into a profile file.

The grid: prefill of one prompt of each length (the format keys prefill by a
batch's prompt tokens; the torch engine packs a batch into one pass, so one
prompt of T tokens stands for any batch of T tokens in all), and the token step
of each batch size at each context length, median of ``reps``. The device is
drained around every timing (CUDA), as ``scripts/gpu_check.py`` does.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from orchestrator.engine.torch_engine import TorchEngine, load_engine
from orchestrator.profiles.profile import EngineProfile, Machine


def _median_s(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _weights_bytes(engine: TorchEngine) -> int:
    tensors = [engine.weights.embed, engine.weights.lm_head, engine.weights.pos,
               *engine.weights.final_norm.values(),
               *(t for layer in engine.weights.layers for t in layer.values())]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def machine_of(device: str) -> Machine:
    if device.startswith("cuda"):
        return Machine(torch.cuda.get_device_name(), f"1x {torch.cuda.get_device_name()}")
    threads = torch.get_num_threads()
    return Machine(platform.node() or "cpu", f"{platform.processor() or 'cpu'}, "
                   f"{threads} torch thread{'s' * (threads > 1)}")


def device_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_profile(
    engine: TorchEngine,
    prefill_tokens: Sequence[int],
    batches: Sequence[int],
    contexts: Sequence[int],
    reps: int = 3,
    memory_bytes: int | None = None,
    name: str = "measured",
) -> EngineProfile:
    """The profile of ``engine`` (a whole model) on its device over the given grid."""
    if not (engine.stage.is_first and engine.stage.is_last):
        raise ValueError("profiling needs a whole-model engine")
    longest = max(*prefill_tokens, max(contexts) + reps + 1)
    if longest > engine.max_seq_len:
        raise ValueError(f"the grid needs {longest} positions; the engine holds "
                         f"{engine.max_seq_len}")
    device = str(engine.device)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, engine.vocab_size, (n,), generator=generator)

    engine.prefill([ids(min(prefill_tokens))], [engine.new_cache()])  # warm-up
    prefill_ms = []
    for n in prefill_tokens:
        prompt = ids(n)
        prefill_ms.append(1e3 * _median_s(
            lambda p=prompt: engine.prefill([p], [engine.new_cache()]), reps, sync))
    decode_ms = []
    for batch in batches:
        row = []
        for context in contexts:
            caches = [engine.new_cache() for _ in range(batch)]
            engine.prefill([ids(context) for _ in range(batch)], caches)
            step = ids(batch)
            row.append(1e3 * _median_s(lambda c=caches, s=step: engine.decode(s, c), reps,
                                       sync))
        decode_ms.append(tuple(row))
    layout = engine.kv_layout
    memory = device_memory(device) if memory_bytes is None else memory_bytes
    return EngineProfile(
        name=name,
        model=f"{engine.config.family}, {engine.config.num_layers} layers, hidden "
              f"{engine.config.hidden_size}",
        machine=machine_of(device),
        prefill_tokens=tuple(prefill_tokens),
        prefill_ms=tuple(round(v, 4) for v in prefill_ms),
        decode_batch=tuple(batches),
        decode_context=tuple(contexts),
        decode_ms=tuple(tuple(round(v, 4) for v in row) for row in decode_ms),
        kv_bytes_per_token=layout.num_layers * layout.token_bytes_per_layer(),
        kv_memory_bytes=max(1, memory - _weights_bytes(engine)),
        source=f"dejavu profile: the torch engine on {device} ({layout.dtype}), median of "
               f"{reps}, torch {torch.__version__}",
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dejavu profile",
                                 description="measure the torch engine into a profile file")
    ap.add_argument("--model", required=True, type=Path, help="HF model folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="default: float32 on CPU, the checkpoint's elsewhere")
    ap.add_argument("--prefill-tokens", type=_ints, default=[16, 32, 64, 128, 256])
    ap.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=_ints, default=[32, 128, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--name", help="profile name (default: <model folder>-<device>)")
    ap.add_argument("--out", type=Path, required=True, help="the profile file to write")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        if args.reps < 1:
            raise ValueError("--reps must be >= 1")
        positions = max(*args.prefill_tokens, max(args.contexts) + args.reps + 1)
        engine = load_engine(args.model, device=args.device, dtype=args.dtype,
                             max_seq_len=positions)
        with torch.no_grad():
            profile = measure_profile(
                engine, args.prefill_tokens, args.batches, args.contexts, args.reps,
                name=args.name or f"{args.model.name}-{args.device}")
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"dejavu profile: error: {e}\n")
    profile.save(args.out)
    print(f"wrote {args.out}: prefill {profile.prefill_ms[0]:.1f}-{profile.prefill_ms[-1]:.1f} "
          f"ms, decode {profile.decode_ms[0][0]:.1f}-{profile.decode_ms[-1][-1]:.1f} ms")
    return 0
