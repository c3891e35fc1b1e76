"""The performance model the planner and the simulator share: a :class:`Profile`.

Byte sizes (W0, C0, K0) come from the model config, the serving dtype and the
workload. Times (Y, t, m) are measured by profiling a live engine
(:func:`measure_timings`), or typed in for what-if planning; ``Profile.source``
says which.

m is measured as the time until a prompt's KV has landed on a receiver, streamed
layer by layer during prefill by the KV library (``KVSender`` -> ``KVReceiver``
over NIXL to another process, or the in-process local transport; see
:mod:`orchestrator.planner.kv_sink`), over the plain prefill time. The source
of m names the transport that measured it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from orchestrator.engine.config import ModelConfig
from orchestrator.kv.connector import KVSender
from orchestrator.layout import DTYPE_BYTES, KVCache
from orchestrator.planner.kv_sink import SECRET, KVSink


@dataclass(frozen=True)
class Workload:
    """What one microbatch looks like: ``batch`` prompts of ``prompt_len``, N new tokens each."""

    prompt_len: int
    new_tokens: int
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("prompt_len", "new_tokens", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Profile:
    """Every symbol of the planner's formulas, in seconds and bytes."""

    L: int
    W0: float  # weights of one layer
    C0: float  # prompt KV of one layer, one microbatch
    K0: float  # generated-token KV of one layer, one microbatch
    M: float  # memory of one machine
    Y: float  # prompt time of one microbatch, whole model
    t: float  # one token step of one microbatch, whole model
    m: float  # prefill time with layer-wise KV streaming / without
    workload: Workload
    source: dict[str, str] = field(default_factory=dict)  # symbol -> how it was obtained

    @property
    def N(self) -> int:
        return self.workload.new_tokens

    @property
    def kv_bytes_per_token(self) -> float:
        """KV of one position over all layers."""
        return self.L * self.C0 / (self.workload.batch * self.workload.prompt_len)

    @property
    def prompt_time_per_token(self) -> float:
        """Y scales about linearly with the prompt tokens of a batch (DejaVu App. A)."""
        return self.Y / (self.workload.batch * self.workload.prompt_len)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(**{**d, "workload": Workload(**d["workload"])})


def check_times(Y: float, t: float, m: float) -> None:
    if Y <= 0 or t <= 0:
        raise ValueError(f"prompt and token times must be positive, got Y={Y}, t={t}")
    if m < 1:
        raise ValueError(f"streaming overhead factor m must be >= 1, got {m}")


def layer_param_count(cfg: ModelConfig) -> int:
    """Parameters of one transformer block: attention, MLP and the two norms."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    mlp = (3 if cfg.gated_mlp else 2) * h * cfg.intermediate_size
    norms = 2 * h * (2 if cfg.norm == "layernorm" else 1)  # layernorm has a bias
    biases = (q + 2 * kv + h + cfg.intermediate_size + h) if cfg.has_bias else 0
    return attention + mlp + norms + biases


def layer_bytes(cfg: ModelConfig, dtype: str, workload: Workload) -> tuple[float, float, float]:
    """(W0, C0, K0) for one layer in ``dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    itemsize = DTYPE_BYTES[dtype]
    kv_per_position = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    W0 = layer_param_count(cfg) * itemsize
    C0 = workload.batch * workload.prompt_len * kv_per_position
    K0 = workload.batch * workload.new_tokens * kv_per_position
    return W0, C0, K0


@dataclass(frozen=True)
class Timings:
    """Measured Y, t, m and the samples behind them."""

    Y: float
    t: float
    m: float
    m_raw: float  # before clamping timer noise below 1
    transport: str  # what carried the streamed KV, e.g. "nixl, 2 processes"
    prefill_s: list[float]
    streamed_prefill_s: list[float]
    step_s: list[float]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _streamed_prefill(
    engine, prompts: list[torch.Tensor], sender: KVSender, sink: KVSink, tag: str
) -> float:
    """Seconds until the prompts' KV, streamed layer by layer during prefill, has landed."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    tickets = [sink.reserve(rid, len(p)) for rid, p in zip(rids, prompts, strict=True)]
    caches = [engine.new_cache() for _ in prompts]
    start = time.perf_counter()
    handles = [sender.start(rid, [ticket]) for rid, ticket in zip(rids, tickets, strict=True)]

    def on_layer(global_layer: int, layer_caches) -> None:
        for handle, cache in zip(handles, layer_caches, strict=True):
            sender.save_layer(handle, global_layer, cache)

    engine.prefill(prompts, caches, on_layer)
    for handle in handles:
        sender.finish(handle)
        sender.wait_for_save(handle, timeout_s=sink.timeout_s)
    seconds = time.perf_counter() - start
    for rid in rids:  # the receiver verified every block: the measured KV really landed
        sink.collect(rid)
    return seconds


def _time_prefills(
    engine, prompts: list[torch.Tensor], reps: int, transport: str
) -> tuple[list[float], list[float], str]:
    """Plain and streamed prefill seconds, alternating, and what carried the KV."""
    with KVSink(engine.kv_layout, len(prompts), transport) as sink:
        sender = KVSender(sink.transport, engine.kv_layout, SECRET, max_inflight=len(prompts))
        try:
            _streamed_prefill(engine, prompts, sender, sink, "warm-up")  # connects to the peer
            plain, streamed = [], []
            for rep in range(reps):
                caches = [engine.new_cache() for _ in prompts]
                plain.append(_timed(lambda c=caches: engine.prefill(prompts, c)))
                streamed.append(_streamed_prefill(engine, prompts, sender, sink, f"rep-{rep}"))
        finally:
            sender.close()
        return plain, streamed, sink.description


def measure_timings(
    engine, workload: Workload, reps: int = 5, seed: int = 0, transport: str = "nixl"
) -> Timings:
    """Profile Y, t and m on a whole-model engine (first and last stage in one).

    Plain and streamed prefills alternate so drift on a shared machine hits
    both alike; medians damp outliers. ``transport`` carries the streamed KV
    (:data:`orchestrator.planner.kv_sink.TRANSPORTS`).
    """
    if not (engine.stage.is_first and engine.stage.is_last):
        raise ValueError("profiling needs a whole-model engine (stage=None)")
    max_seq = engine.kv_layout.max_seq_len
    if workload.prompt_len + workload.new_tokens > max_seq:
        raise ValueError(
            f"prompt_len + new_tokens = {workload.prompt_len + workload.new_tokens} "
            f"exceeds the engine's max sequence length {max_seq}"
        )
    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, engine.vocab_size, (workload.prompt_len,), generator=generator)
        for _ in range(workload.batch)
    ]

    def fresh() -> list[KVCache]:
        return [engine.new_cache() for _ in range(workload.batch)]

    with torch.inference_mode():
        engine.prefill(prompts, fresh())  # warm-up
        plain, streamed, transport_used = _time_prefills(engine, prompts, reps, transport)
        caches = fresh()
        logits = engine.prefill(prompts, caches)
        ids = torch.stack([row.argmax(-1) for row in logits])
        steps = []
        for _ in range(min(workload.new_tokens, 32)):
            start = time.perf_counter()
            logits = engine.decode(ids, caches)
            steps.append(time.perf_counter() - start)
            ids = logits.argmax(-1)
    Y = statistics.median(plain)
    m_raw = statistics.median(streamed) / Y
    return Timings(
        Y=Y,
        t=statistics.mean(steps),
        m=max(1.0, m_raw),
        m_raw=m_raw,
        transport=transport_used,
        prefill_s=plain,
        streamed_prefill_s=streamed,
        step_s=steps,
    )


def profile_from_config(
    cfg: ModelConfig,
    workload: Workload,
    memory_bytes: float,
    Y: float,
    t: float,
    m: float,
    dtype: str | None = None,
    source: str = "typed",
) -> Profile:
    check_times(Y, t, m)
    W0, C0, K0 = layer_bytes(cfg, dtype or cfg.dtype, workload)
    return Profile(
        L=cfg.num_layers, W0=W0, C0=C0, K0=K0, M=memory_bytes, Y=Y, t=t, m=m,
        workload=workload,
        source={"W0": "config", "C0": "config", "K0": "config", "M": "given",
                "Y": source, "t": source, "m": source},
    )


def timings_from_engine_profile(engine_profile, workload: Workload) -> tuple[float, float]:
    """(Y, t) of ``workload`` from an engine profile's cost model, the one the emulated engine
    sleeps: Y one prefill of the microbatch's prompt tokens, t its mean token step (context
    from prompt_len to prompt_len + N, so the middle)."""
    Y = engine_profile.prefill_s(workload.batch * workload.prompt_len)
    t = engine_profile.decode_s(workload.batch, workload.prompt_len + workload.new_tokens / 2)
    return Y, t


def profile_live(
    model_dir: str | Path,
    workload: Workload,
    memory_bytes: float,
    device: str = "cpu",
    reps: int = 5,
    transport: str = "nixl",
) -> tuple[Profile, Timings]:
    """Load the model, measure Y, t, m on it (m over ``transport``), and size its layers."""
    from orchestrator.engine.torch_engine import load_engine

    cfg = ModelConfig.from_dir(model_dir)
    max_seq_len = workload.prompt_len + workload.new_tokens
    engine = load_engine(model_dir, stage=None, device=device, max_seq_len=max_seq_len)
    timings = measure_timings(engine, workload, reps=reps, transport=transport)
    profile = profile_from_config(
        cfg, workload, memory_bytes, timings.Y, timings.t, timings.m,
        dtype=engine.kv_layout.dtype, source="measured",
    )
    source = {**profile.source, "m": f"measured (KV over {timings.transport})"}
    return replace(profile, source=source), timings
