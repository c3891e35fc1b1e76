"""``dejavu bench kv``: the KV-streaming ablation of DejaVu Fig. 11, two processes over NIXL.

This process runs the torch engine (prefill a prompt, then greedy decode) and
streams the KV cache to a receiver process (a ``KVReceiver`` over NIXL), one
mode at a time, each optimisation added to the previous one:

- ``none``: no streaming (the baseline).
- ``per-slice``: after prefill, one transfer per (layer, K/V, head) run; after
  every decode step, one transfer per (layer, K/V, head) slice; blocking.
- ``buffered``: the prompt sent after prefill, one transfer per layer
  (KVSender); each step's slices gathered into one staging block and sent as
  one contiguous transfer to the receiver's landing ring, scattered there
  (DeltaStreamer, waiting for each step to land).
- ``layer-wise``: + the prompt streams layer by layer during prefill (KVSender).
- ``overlap``: + each step's delta streams in the background while the next
  step computes (DeltaStreamer).

Every mode's received cache is hashed in the receiver and compared with the
engine's own cache; a mismatch is reported, not hidden. Ceilings measured in
the same run: a 64 MiB host memcpy and a 64 MiB NIXL WRITE to the receiver.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from clients.common import write_csv
from clients.provenance import save_figure
from orchestrator.engine.checkpoint import PRESETS, make_checkpoint
from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.delta import DeltaStreamer
from orchestrator.kv.primitives import kv_spans
from orchestrator.kv.transport.base import KVPoll, Region
from orchestrator.kv.transport.nixl import NixlTransport
from orchestrator.kv.wire import Ticket
from orchestrator.layout import KVCache, KVLayout

SECRET = b"dejavu-bench"
MODES = ["none", "per-slice", "buffered", "layer-wise", "overlap"]
CEILING_BYTES = 64 << 20


def kv_hash(cache: KVCache, positions: int) -> str:
    return hashlib.sha256(cache.data[:, :, :, :positions].contiguous().numpy()).hexdigest()


# -- the receiver process ---------------------------------------------------------------


def receiver_main(inbox: mp.Queue, outbox: mp.Queue, layout_dict: dict) -> None:
    """Serve reserve / check / release requests until told to stop."""
    torch.set_num_threads(1)
    layout = KVLayout(**layout_dict)
    transport = NixlTransport(name="bench-receiver")
    landing = torch.empty(CEILING_BYTES, dtype=torch.uint8)
    landing_addr = transport.register(landing).addr
    # A short timeout only shortens the quarantine of slots the raw modes never
    # complete through headers; every wait below passes its own timeout.
    receiver = KVReceiver(transport, layout, num_slots=2 * len(MODES), secret=SECRET, timeout_s=0.2)
    outbox.put((transport.name, transport.metadata(), landing_addr))
    slots: dict[str, int] = {}
    while True:
        try:
            message = inbox.get(timeout=0.001)
        except queue.Empty:
            receiver.progress()  # scatter landed deltas, as a decode node does every step
            continue
        kind, rid, *args = message
        if kind == "stop":
            break
        if kind == "reserve":
            deadline = time.monotonic() + 10
            while True:  # quarantined slots come back after the short timeout
                try:
                    ticket = receiver.reserve(rid, args[0])
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            slot_addr = Ticket.decode(ticket, SECRET).slot_addr
            slots[rid] = (slot_addr - receiver.pool.data_ptr()) // layout.slot_bytes()
            outbox.put(ticket)
        elif kind == "check":  # (positions, whether the mode used headers)
            positions, with_headers = args
            if with_headers:
                receiver.wait(rid, timeout_s=60)
                deadline = time.monotonic() + 60
                while receiver.cache(rid).length < positions and time.monotonic() < deadline:
                    time.sleep(0.001)
            outbox.put(kv_hash(KVCache(layout, receiver.pool[slots[rid]]), positions))
        elif kind == "release":
            receiver.release(rid)
    transport.close()


# -- the engine process -----------------------------------------------------------------


@dataclass
class ModeResult:
    model: str
    mode: str
    prompt_len: int
    new_tokens: int
    # Load from other processes only ever adds time: the fastest prefill and the
    # median step are the robust estimates of each mode's own cost.
    prefill_ms: float  # fastest of the repeats, until the prompt's KV has landed
    decode_ms_per_token: float  # median step (delta included) + final flush / steps
    delta_send_us: float  # median blocking streaming time per step (0 for none)
    delta_gbps: float  # one step's delta bytes / that time
    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0
    verified: bool = True


@dataclass
class ModeRun:
    """One mode's state across the interleaved rounds (its own registered cache)."""

    mode: str
    cache: KVCache
    prefill_s: list[float] = field(default_factory=list)
    rid: str = ""
    ticket: bytes = b""
    tokens: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # each decode step, delta included
    send_s: list[float] = field(default_factory=list)  # blocking streaming time of each step
    flush_s: float = 0.0  # waiting for background deltas after the last step
    streamer: DeltaStreamer | None = None

    @property
    def uses_headers(self) -> bool:
        """Streams through KVSender / DeltaStreamer (else raw transfers, or nothing)."""
        return self.mode not in ("none", "per-slice")


class Bench:
    """One model: the engine, a registered cache per mode, the receiver process.

    Modes are interleaved (prefill round-robin, then decode one step of each
    mode in turn) so that load from other processes hits every mode alike and
    the slowdowns are ratios measured under the same conditions.
    """

    def __init__(self, model_dir: Path, prompt_len: int, new_tokens: int, repeats: int):
        self.prompt_len, self.new_tokens, self.repeats = prompt_len, new_tokens, repeats
        self.engine = load_engine(model_dir, max_seq_len=prompt_len + new_tokens)
        self.layout = self.engine.kv_layout
        self.layers = range(self.layout.num_layers)
        self.transport = NixlTransport(name="bench-engine")
        self.runs = [ModeRun(mode, self.engine.new_cache()) for mode in MODES]
        for run in self.runs:
            self.transport.register(run.cache.data)
        generator = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(0, self.engine.vocab_size, (prompt_len,), generator=generator)
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=receiver_main, args=(self.inbox, self.outbox, self.layout.to_dict())
        )
        self.process.start()
        self.peer, metadata, self.landing_addr = self.outbox.get(timeout=120)
        self.transport.add_peer(self.peer, metadata)

    def close(self) -> None:
        self.inbox.put(("stop", ""))
        self.process.join(timeout=30)
        self.transport.close()

    def ask(self, *message):
        self.inbox.put(message)
        return self.outbox.get(timeout=120)

    def ceilings(self) -> dict[str, float]:
        src = torch.randn(CEILING_BYTES // 4)
        dst = torch.empty_like(src)
        memcpy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
        ceiling_src = torch.empty(CEILING_BYTES, dtype=torch.uint8)
        local = self.transport.register(ceiling_src)
        remote = Region(self.landing_addr, CEILING_BYTES)
        nixl = min(_timed(lambda: self._write_all([(local, remote)])) for _ in range(5))
        self.transport.deregister(ceiling_src)
        return {
            "memcpy_gbps": CEILING_BYTES / memcpy / 1e9,
            "nixl_gbps": CEILING_BYTES / nixl / 1e9,
        }

    def run(self) -> list[ModeResult]:
        self._warm_up()
        for repeat in range(self.repeats):
            for run in self.runs:
                previous = run.rid
                run.rid = f"{run.mode}-{repeat}"
                run.ticket = self.ask("reserve", run.rid, self.prompt_len)
                if previous:
                    self.inbox.put(("release", previous))
                seconds, logits = self._prefill(run)
                run.prefill_s.append(seconds)
                run.tokens = [int(logits.argmax())]
        for run in self.runs:
            if run.uses_headers:
                run.streamer = DeltaStreamer(self.transport, self.layout, SECRET, max_batch=1)
                run.streamer.add_target(run.rid, run.ticket)
        for _ in range(self.new_tokens - 1):
            for run in self.runs:
                self._step(run)
        for run in self.runs:
            if run.streamer is not None:
                run.flush_s = _timed(run.streamer.flush)
                run.streamer.close()
        return [self._result(run) for run in self.runs]

    def _warm_up(self) -> None:
        """First-touch allocations and lazy initialisation, outside every timing."""
        scratch = self.engine.new_cache()
        (logits,) = self.engine.prefill([self.prompt], [scratch])
        self.engine.decode(logits.argmax().view(1), [scratch])

    def _result(self, run: ModeRun) -> ModeResult:
        positions = self.prompt_len + self.new_tokens - 1
        received = self.ask("check", run.rid, positions, run.uses_headers)
        self.inbox.put(("release", run.rid))
        steps = self.new_tokens - 1
        send_s = statistics.median(run.send_s)
        reference = self.runs[0]
        return ModeResult(
            model="",
            mode=run.mode,
            prompt_len=self.prompt_len,
            new_tokens=self.new_tokens,
            prefill_ms=min(run.prefill_s) * 1e3,
            decode_ms_per_token=(statistics.median(run.step_s) + run.flush_s / steps) * 1e3,
            delta_send_us=send_s * 1e6,
            delta_gbps=self.layout.step_bytes() / send_s / 1e9 if send_s else 0.0,
            verified=run.tokens == reference.tokens
            and (run.mode == "none" or received == kv_hash(run.cache, positions)),
        )

    def _prefill(self, run: ModeRun) -> tuple[float, torch.Tensor]:
        """Seconds until the prompt's KV has landed (computed, for ``none``), and the logits."""
        sender = KVSender(self.transport, self.layout, SECRET, max_inflight=1)
        run.cache.length = 0
        start = time.perf_counter()
        if not run.uses_headers:
            (logits,) = self.engine.prefill([self.prompt], [run.cache])
            if run.mode == "per-slice":
                ticket = Ticket.decode(run.ticket, SECRET)
                self._send_slices(run.cache, ticket, range(self.prompt_len))
        else:
            handle = sender.start(run.rid, [run.ticket])

            def stream_layer(layer: int, caches) -> None:
                sender.save_layer(handle, layer, caches[0])

            layer_wise = run.mode != "buffered"
            (logits,) = self.engine.prefill(
                [self.prompt], [run.cache], on_layer=stream_layer if layer_wise else None
            )
            if not layer_wise:
                for layer in self.layers:
                    stream_layer(layer, [run.cache])
            sender.finish(handle)
            sender.wait_for_save(handle, timeout_s=60)
        seconds = time.perf_counter() - start
        sender.close()
        return seconds, logits

    def _step(self, run: ModeRun) -> None:
        """One greedy decode step of ``run``, then its delta, per the mode."""
        position = run.cache.length
        start = time.perf_counter()
        logits = self.engine.decode(torch.tensor([run.tokens[-1]]), [run.cache])[0]
        run.tokens.append(int(logits.argmax()))
        computed = time.perf_counter()
        if run.mode == "per-slice":
            ticket = Ticket.decode(run.ticket, SECRET)
            self._send_slices(run.cache, ticket, range(position, position + 1))
        elif run.streamer is not None:
            run.streamer.submit([run.rid], [run.cache], [position])
            if run.mode != "overlap":
                run.streamer.flush()
        done = time.perf_counter()
        run.step_s.append(done - start)
        run.send_s.append(done - computed if run.mode != "none" else 0.0)

    def _write_all(self, pairs, separately: bool = False) -> None:
        """Post ``pairs`` as one transfer (or one per pair) and wait until all landed."""
        batches = [[p] for p in pairs] if separately else [pairs]
        handles = [self.transport.write(self.peer, batch) for batch in batches]
        deadline = time.monotonic() + 60
        for handle in handles:
            while (state := self.transport.poll(handle)) == KVPoll.TRANSFERRING:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer to {self.peer} unfinished after 60 s")
            if state == KVPoll.FAILED:
                raise RuntimeError(handle.error)

    def _send_slices(self, cache: KVCache, ticket, positions: range) -> None:
        """The naive way: one transfer per contiguous (layer, K/V, head) run, no staging."""
        local = kv_spans(self.layout, cache.data.data_ptr(), self.layers, positions)
        remote = kv_spans(ticket.layout, ticket.slot_addr, self.layers, positions)
        self._write_all(list(zip(local, remote, strict=True)), separately=True)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the command --------------------------------------------------------------------------


def _model_dir(spec: str, models_dir: Path) -> Path | None:
    arch, _, preset = spec.partition(":")
    if preset not in PRESETS.get(arch, {}):
        print(f"skipping {spec}: the engine has no {arch}/{preset} preset")
        return None
    folder = models_dir / f"{arch}-{preset}"
    if not (folder / "config.json").exists():
        make_checkpoint(arch, preset, folder)
    return folder


def run(spec: str, model_dir: Path, args: argparse.Namespace) -> list[dict]:
    bench = Bench(model_dir, args.prompt, args.new_tokens, args.repeats)
    try:
        ceilings = bench.ceilings()
        results = bench.run()
    finally:
        bench.close()
    base = results[0]
    rows = []
    for result in results:
        result.model = spec
        result.prefill_slowdown = result.prefill_ms / base.prefill_ms
        result.decode_slowdown = result.decode_ms_per_token / base.decode_ms_per_token
        rows.append({**asdict(result), **ceilings})
    return rows


def report(rows: list[dict], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV streaming ablation (DejaVu Fig. 11), two processes over NIXL")
    columns = [
        ("model", "{}"),
        ("mode", "{}"),
        ("prefill_ms", "{:.1f}"),
        ("prefill_slowdown", "{:.3f}x"),
        ("decode_ms_per_token", "{:.2f}"),
        ("decode_slowdown", "{:.3f}x"),
        ("delta_send_us", "{:.0f}"),
        ("delta_gbps", "{:.3f}"),
        ("verified", "{}"),
    ]
    for name, _ in columns:
        table.add_column(name)
    for row in rows:
        table.add_row(*(fmt.format(row[name]) for name, fmt in columns))
    console = Console(width=160)
    console.print(table)
    for model in dict.fromkeys(r["model"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["model"] == model}
        slices, buffered = by_mode["per-slice"], by_mode["buffered"]
        console.print(
            f"{model} (prompt {slices['prompt_len']}, {slices['new_tokens']} new tokens): "
            f"buffered delta send {buffered['delta_send_us']:.0f} us vs per-slice "
            f"{slices['delta_send_us']:.0f} us per step "
            f"({slices['delta_send_us'] / buffered['delta_send_us']:.1f}x); "
            f"layer-wise prefill slowdown {by_mode['layer-wise']['prefill_slowdown']:.3f}x; "
            f"overlap decode slowdown {by_mode['overlap']['decode_slowdown']:.3f}x; "
            f"ceilings: memcpy {slices['memcpy_gbps']:.2f} GB/s, "
            f"NIXL 64 MiB {slices['nixl_gbps']:.2f} GB/s"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "ablation.csv", rows)
    plot(rows, out / "ablation.png")
    console.print(f"wrote {out / 'ablation.csv'} and {out / 'ablation.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(models)
    for ax, key, title in (
        (axes[0], "prefill_slowdown", "prompt time vs no streaming"),
        (axes[1], "decode_slowdown", "time per token vs no streaming"),
    ):
        for i, model in enumerate(models):
            values = [r[key] for r in rows if r["model"] == model]
            ax.bar([m + i * width for m in range(len(MODES))], values, width, label=model)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([m + width * (len(models) - 1) / 2 for m in range(len(MODES))], MODES)
        ax.set_title(title)
        ax.set_ylabel("slowdown (x)")
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu bench kv", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        action="append",
        help="arch:preset (repeatable); default gpt2:small and gpt2:medium",
    )
    parser.add_argument("--prompt", type=int, default=500, help="prompt tokens (paper: 500)")
    parser.add_argument("--new-tokens", type=int, default=500, help="new tokens (paper: 500)")
    parser.add_argument("--repeats", type=int, default=5, help="prefills per mode (fastest kept)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/kv"))
    parser.add_argument("--models-dir", type=Path, help="checkpoint cache (default OUT/models)")
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model = args.model or ["gpt2:tiny"]
        args.prompt, args.new_tokens, args.repeats = 24, 6, 1
    specs = args.model or ["gpt2:small", "gpt2:medium"]
    if args.prompt < 1 or args.new_tokens < 2:
        parser.error("need --prompt >= 1 and --new-tokens >= 2")
    torch.set_num_threads(1)  # the receiver process and NIXL share the remaining core
    print(
        f"prompt {args.prompt} tokens, {args.new_tokens} new tokens, {args.repeats} prefills/mode"
    )
    rows = []
    for spec in specs:
        model_dir = _model_dir(spec, args.models_dir or args.out / "models")
        if model_dir is not None:
            rows.extend(run(spec, model_dir, args))
    if not rows:
        print("no model to run")
        return 1
    report(rows, args.out)
    return 0 if all(r["verified"] for r in rows) else 1
