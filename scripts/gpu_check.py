"""One prepared check of the CUDA paths (scripts/gpu_check.sh runs it); ``--cpu`` runs the
same measurements on the CPU, so CI tests the script itself.

It needs torch, safetensors, tokenizers and transformers (dummy weights), nothing
else of the project's dependencies (no tritonserver, no NIXL): the KV stream between
the two processes is host-staged. It writes one JSON report:

- ``exact``: the torch engine on the device, fp32, token-exact against the CPU fp32
  reference (GPT-2 and Llama dummy weights); ``bf16``: the bf16 engine's agreement rate;
- ``timing``: prefill and decode times on the device;
- ``streaming``: layer-wise KV streaming to a second process; ``on_layer`` records a
  CUDA event after each layer and the copy waits on it (not on the whole prefill), the
  receiver's KV hash-checked; the prefill slowdown it costs;
- ``delta``: a token step's KV delta copied per slice (2 x layers x heads copies) against
  one buffered copy (DejaVu reports 95x);
- ``swap``: a microbatch's KV swapped in from pinned host memory on a copy stream while
  another computes: overlap fraction, and the largest batch under a fixed device budget;
- ``profile``: the torch engine's engine profile on the device (Llama dummy weights, the
  format of ``dejavu profile``), also written beside the report as
  ``<report stem>-profile.json`` for ``--engine emulated --profile``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from orchestrator.engine.checkpoint import make_checkpoint
from orchestrator.engine.measure import measure_profile
from orchestrator.engine.reference import generate
from orchestrator.engine.torch_engine import load_engine

PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11], [300, 2, 8, 64, 128, 9]]


class Device:
    """CUDA, or the CPU standing in for it (events and streams become no-ops)."""

    def __init__(self, name: str) -> None:
        self.name, self.cuda = name, name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 3) -> float:
        """Best wall time of ``fn`` in seconds, the device drained before and after."""
        best = float("inf")
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            best = min(best, time.perf_counter() - start)
        return best

    def event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def host(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)


def check_exact(device: Device, model: Path, tokens: int) -> dict:
    reference = generate([load_engine(model, max_seq_len=256)], PROMPTS, tokens)
    fp32 = generate([load_engine(model, device=device.name, dtype="float32", max_seq_len=256)],
                    PROMPTS, tokens)
    bf16 = generate([load_engine(model, device=device.name, dtype="bfloat16",
                                 max_seq_len=256)], PROMPTS, tokens)
    same = sum(a == b for r, o in zip(reference, bf16, strict=True)
               for a, b in zip(r, o, strict=True))
    return {"token_exact_fp32": fp32 == reference,
            "bf16_agreement": same / sum(len(r) for r in reference)}


def check_timing(device: Device, model: Path, prompt_len: int, batch: int) -> dict:
    engine = load_engine(model, device=device.name, max_seq_len=prompt_len + 16)
    prompts = [torch.randint(0, 500, (prompt_len,)) for _ in range(batch)]
    caches = [engine.new_cache() for _ in prompts]

    def prefill() -> None:
        for cache in caches:
            cache.length = 0
        engine.prefill(prompts, caches)

    prefill_s = device.timed(prefill)
    step = torch.randint(0, 500, (batch,))

    def decode() -> None:
        for cache in caches:
            cache.length = prompt_len
        for _ in range(8):
            engine.decode(step, caches)

    return {"prompt_len": prompt_len, "batch": batch, "prefill_ms": prefill_s * 1e3,
            "decode_ms_per_step": device.timed(decode) / 8 * 1e3}


def receiver(device_name: str, shape, dtype, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """The second process: each layer's KV from shared host memory into its device KV."""
    cache = torch.zeros(shape, dtype=dtype, device=device_name)
    staging = inbox.get()  # the shared host buffer
    while (layer := inbox.get()) is not None:
        cache[layer].copy_(staging[layer], non_blocking=False)
    outbox.put(hashlib.sha256(cache.cpu().view(torch.uint8).numpy()).hexdigest())


def check_streaming(device: Device, model: Path, prompt_len: int) -> dict:
    engine = load_engine(model, device=device.name, max_seq_len=prompt_len)
    prompt = [torch.randint(0, 500, (prompt_len,))]
    cache = engine.new_cache()
    staging = torch.zeros(cache.data.shape, dtype=cache.data.dtype).share_memory_()
    ctx = mp.get_context("spawn")  # torch.multiprocessing: the staging tensor is shared
    inbox, outbox = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=receiver, args=(device.name, tuple(cache.data.shape),
                                              cache.data.dtype, inbox, outbox))
    peer.start()
    inbox.put(staging)
    ready: queue.Queue = queue.Queue()

    def copier() -> None:
        stream = torch.cuda.Stream() if device.cuda else None
        while (item := ready.get()) is not None:
            layer, event = item
            if event is not None:
                stream.wait_event(event)  # only this layer's work, not the prefill's rest
                with torch.cuda.stream(stream):
                    staging[layer].copy_(cache.data[layer], non_blocking=True)
                stream.synchronize()
            else:
                staging[layer].copy_(cache.data[layer])
            inbox.put(layer)

    def on_layer(layer: int, caches) -> None:
        ready.put((layer, device.event()))

    def run(streaming: bool) -> None:
        cache.length = 0
        if not streaming:
            engine.prefill(prompt, [cache])
            return
        thread = threading.Thread(target=copier)
        thread.start()
        engine.prefill(prompt, [cache], on_layer=on_layer)
        ready.put(None)
        thread.join()

    plain = device.timed(lambda: run(False))
    streamed = device.timed(lambda: run(True))
    inbox.put(None)
    received = outbox.get(timeout=120)
    peer.join(30)
    sent = hashlib.sha256(cache.data.cpu().view(torch.uint8).numpy()).hexdigest()
    return {"prompt_len": prompt_len, "prefill_ms": plain * 1e3,
            "prefill_streaming_ms": streamed * 1e3, "slowdown": streamed / plain,
            "receiver_kv_matches": received == sent,
            "on_layer_signal": "cuda event per layer" if device.cuda else "synchronous (cpu)",
            "transport": "host-staged (shared pinned memory; no NIXL)"}


def check_delta(device: Device, model: Path, steps: int = 50) -> dict:
    engine = load_engine(model, device=device.name, max_seq_len=256)
    data = engine.new_cache().data  # [layers, 2, heads, seq, head_dim]
    layers, _, heads, _, head_dim = data.shape
    host_slices = device.host(torch.empty(layers, 2, heads, head_dim, dtype=data.dtype))
    host_buffer = device.host(host_slices)
    device_buffer = torch.empty(host_slices.shape, dtype=data.dtype, device=device.name)

    def per_slice() -> None:
        for t in range(steps):
            for layer in range(layers):
                for kv in range(2):
                    for h in range(heads):
                        host_slices[layer, kv, h].copy_(data[layer, kv, h, t],
                                                        non_blocking=True)

    def buffered() -> None:
        for t in range(steps):
            device_buffer.copy_(data[:, :, :, t])  # one gather on the device
            host_buffer.copy_(device_buffer, non_blocking=True)  # one transfer

    slices, one = device.timed(per_slice) / steps, device.timed(buffered) / steps
    return {"copies_per_step_per_slice": layers * 2 * heads, "per_slice_us": slices * 1e6,
            "buffered_us": one * 1e6, "speedup": slices / one}


def check_swap(device: Device, model: Path, prompt_len: int, batch: int) -> dict:
    engine = load_engine(model, device=device.name, max_seq_len=prompt_len + 8)
    caches = [engine.new_cache() for _ in range(batch)]
    engine.prefill([torch.randint(0, 500, (prompt_len,)) for _ in caches], caches)
    host = [device.host(c.data) for c in caches]  # the other microbatch, swapped out
    incoming = [torch.empty_like(c.data) for c in caches]
    step = torch.randint(0, 500, (batch,))
    stream = torch.cuda.Stream() if device.cuda else None

    def compute() -> None:
        for c in caches:
            c.length = prompt_len
        engine.decode(step, caches)

    def copy() -> None:
        for src, dst in zip(host, incoming, strict=True):
            dst.copy_(src, non_blocking=device.cuda)

    def both() -> None:
        if stream is None:
            copy()
        else:
            with torch.cuda.stream(stream):
                copy()
        compute()

    t_compute, t_copy, t_both = device.timed(compute), device.timed(copy), device.timed(both)
    hidden = max(0.0, t_compute + t_copy - t_both)
    slot = engine.kv_layout.slot_bytes()
    budget, microbatches = 64 * slot, 4
    return {"compute_ms": t_compute * 1e3, "swap_in_ms": t_copy * 1e3,
            "overlapped_ms": t_both * 1e3,
            "overlap_fraction": min(1.0, hidden / min(t_compute, t_copy)),
            "device_budget_bytes": budget, "microbatches": microbatches,
            "largest_batch_resident": budget // slot // microbatches,
            "largest_batch_swapped": budget // slot // 2}  # the computing one + the next


def check_profile(device: Device, model: Path, out: Path) -> dict:
    """The engine profile of ``model`` on the device (a small grid on the CPU stand-in)."""
    grid = (([8, 32], [1, 4], [8, 32]) if not device.cuda else
            ([128, 512, 1024, 2048], [1, 4, 16, 64], [128, 512, 1024]))
    engine = load_engine(model, device=device.name, max_seq_len=max(grid[0] + grid[2]) + 8)
    with torch.no_grad():
        profile = measure_profile(engine, *grid, reps=3,
                                  name=f"torch-{model.name}-{device.name}")
    profile.save(out)
    return {"file": str(out), **profile.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU stands in for CUDA")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu")
    device = Device("cpu" if args.cpu else "cuda")
    preset = "tiny" if args.cpu else "small"
    prompt_len, tokens = (64, 16) if args.cpu else (512, 64)
    report: dict = {"device": torch.cuda.get_device_name() if device.cuda else "cpu",
                    "torch": torch.__version__, "preset": preset}
    with tempfile.TemporaryDirectory() as tmp:
        models = {arch: make_checkpoint(arch, preset, Path(tmp) / arch) for arch in
                  ("gpt2", "llama")}
        report["exact"] = {arch: check_exact(device, m, tokens) for arch, m in models.items()}
        report["timing"] = {arch: check_timing(device, m, prompt_len, 8)
                            for arch, m in models.items()}
        report["streaming"] = check_streaming(device, models["gpt2"], prompt_len)
        report["delta"] = check_delta(device, models["gpt2"])
        report["swap"] = check_swap(device, models["llama"], prompt_len, 8)
        report["profile"] = check_profile(
            device, models["llama"], args.out.with_name(f"{args.out.stem}-profile.json"))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    ok = all(r["token_exact_fp32"] for r in report["exact"].values())
    return 0 if ok and report["streaming"]["receiver_kv_matches"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
