"""The performance model the planner and the simulator share: a :class:`Profile`.

Byte sizes (W0, C0, K0) come from the model config, the serving dtype and the
workload. Times (Y, t, m) are measured by profiling a live engine
(:func:`measure_timings`), or typed in for what-if planning; ``Profile.source``
says which.

m is measured as prefill time with a per-layer KV copy-out hook over prefill
time without it. The hook copies each layer's fresh KV into a separate host
buffer synchronously, as a layer-wise sender would hand it to a transport; it
does not overlap the copy with compute, so it bounds m from above.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from orchestrator.engine.config import ModelConfig
from orchestrator.kv.layout import DTYPES, KVCache


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

    def with_times(self, Y: float, t: float, m: float, how: str = "typed") -> Profile:
        """A what-if copy with other timings (the byte sizes stay)."""
        check_times(Y, t, m)
        return replace(self, Y=Y, t=t, m=m, source={**self.source, "Y": how, "t": how, "m": how})


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
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
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
    prefill_s: list[float]
    streamed_prefill_s: list[float]
    step_s: list[float]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def host_copy_hook(caches: Sequence[KVCache], prompt_len: int) -> Callable:
    """An ``on_layer`` hook that copies each layer's prompt KV to its own host buffer."""
    buffers = [
        torch.empty(c.data[:, :, :, :prompt_len].shape, dtype=c.data.dtype) for c in caches
    ]

    def on_layer(global_layer: int, layer_caches: Sequence[KVCache]) -> None:
        for buffer, cache in zip(buffers, layer_caches, strict=True):
            local = global_layer - cache.layout.first_layer
            buffer[local].copy_(cache.layer(global_layer)[:, :, :prompt_len])

    return on_layer


def measure_timings(engine, workload: Workload, reps: int = 5, seed: int = 0) -> Timings:
    """Profile Y, t and m on a whole-model engine (first and last stage in one).

    Plain and streamed prefills alternate so drift on a shared machine hits
    both alike; medians damp outliers.
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
        plain, streamed = [], []
        for _ in range(reps):
            caches = fresh()
            plain.append(_timed(lambda c=caches: engine.prefill(prompts, c)))
            caches = fresh()
            hook = host_copy_hook(caches, workload.prompt_len)
            streamed.append(_timed(lambda c=caches, h=hook: engine.prefill(prompts, c, h)))
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


def profile_live(
    model_dir: str | Path,
    workload: Workload,
    memory_bytes: float,
    device: str = "cpu",
    reps: int = 5,
) -> tuple[Profile, Timings]:
    """Load the model, measure Y, t, m on it, and size its layers."""
    from orchestrator.engine.torch_engine import load_engine

    cfg = ModelConfig.from_dir(model_dir)
    max_seq_len = workload.prompt_len + workload.new_tokens
    engine = load_engine(model_dir, stage=None, device=device, max_seq_len=max_seq_len)
    timings = measure_timings(engine, workload, reps=reps)
    profile = profile_from_config(
        cfg, workload, memory_bytes, timings.Y, timings.t, timings.m,
        dtype=engine.kv_layout.dtype, source="measured",
    )
    return profile, timings
