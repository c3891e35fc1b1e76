"""The engine profile file (JSON, version 1) and the cost model it defines.

One file describes one engine on one machine. It is what the emulated engine
sleeps, and what the planner and the simulator predict from::

    {
      "format": "dejavu-profile", "version": 1,
      "name": "splitwise-llama2-70b-h100",
      "model": "llama2-70b",                 # what ran
      "machine": {                           # what it ran on (one serving node)
        "name": "dgx-h100", "accelerators": "8x h100-80gb, TP 8",
        "cost_per_hour": 4.76, "cost_unit": "...",   # null where unknown
        "power_w": 10200, "power_note": "..."         # null where unknown
      },
      "prefill": {                           # one prefill pass of a batch of prompts
        "tokens": [128, 256, ...],           # prompt tokens of the whole batch, ascending
        "ms": [58.2, 51.7, ...]              # its time
      },
      "decode": {                            # one token step of a batch
        "batch": [1, 2, 4, ...],             # sequences in the step, ascending
        "context": [192, 576, ...],          # tokens each sequence holds, ascending
        "ms": [[...], ...]                   # ms[i][j]: batch[i] at context[j]
      },
      "kv_bytes_per_token": 327680,          # all layers, K and V, serving dtype
      "kv_memory_bytes": 5.4e11,             # memory left for KV on the machine
      "source": "where every number comes from (paper figure, file, command)",
      "license": "the source's license, for shipped copies"
    }

Between grid points the cost model interpolates linearly (bilinearly on the
decode grid); past the last point it extrapolates the last segment, as
SplitwiseSim's own model does for prefill; below the first it holds the first
value (a step never gets cheaper than the smallest one measured).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

FORMAT = "dejavu-profile"
VERSION = 1
SHIPPED = Path(__file__).parent / "data"


def _check_axis(name: str, values: Sequence[float]) -> None:
    if not values:
        raise ValueError(f"profile axis {name} is empty")
    if any(v <= 0 for v in values):
        raise ValueError(f"profile axis {name} must be positive, got {list(values)}")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"profile axis {name} must be strictly ascending, got {list(values)}")


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x); the last segment extrapolates, below xs[0] holds ys[0]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect_right(xs, x), len(xs) - 1)  # segment (i-1, i); past the end: the last one
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Machine:
    name: str
    accelerators: str
    cost_per_hour: float | None = None
    cost_unit: str = ""
    power_w: float | None = None
    power_note: str = ""


@dataclass(frozen=True)
class EngineProfile:
    """Step times of one engine on one machine, and the cost model over them (seconds)."""

    name: str
    model: str
    machine: Machine
    prefill_tokens: tuple[float, ...]
    prefill_ms: tuple[float, ...]
    decode_batch: tuple[float, ...]
    decode_context: tuple[float, ...]
    decode_ms: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: float
    kv_memory_bytes: float
    source: str
    license: str = ""
    extra: dict = field(default_factory=dict)  # free-form provenance (grids' origins, reps)

    def __post_init__(self) -> None:
        _check_axis("prefill.tokens", self.prefill_tokens)
        _check_axis("decode.batch", self.decode_batch)
        _check_axis("decode.context", self.decode_context)
        if len(self.prefill_ms) != len(self.prefill_tokens):
            raise ValueError("prefill.ms needs one time per prefill.tokens entry")
        if len(self.decode_ms) != len(self.decode_batch) or any(
            len(row) != len(self.decode_context) for row in self.decode_ms
        ):
            raise ValueError("decode.ms must be a batch x context grid")
        times = [*self.prefill_ms, *(v for row in self.decode_ms for v in row)]
        if any(v <= 0 for v in times):
            raise ValueError("profile times must be positive")
        if self.kv_bytes_per_token <= 0 or self.kv_memory_bytes <= 0:
            raise ValueError("kv_bytes_per_token and kv_memory_bytes must be positive")

    # -- the cost model ------------------------------------------------------

    def prefill_s(self, prompt_tokens: int, cached: int = 0) -> float:
        """One prefill pass over ``prompt_tokens`` new tokens (all prompts of the batch) on
        top of ``cached`` tokens their slots already hold (a prefix-cache hit, an earlier
        chunk): what the whole pass costs beyond the cached part's own, and never less than
        the new tokens alone (a pass's fixed cost)."""
        if prompt_tokens < 1:
            raise ValueError(f"a prefill needs at least one token, got {prompt_tokens}")
        if cached < 0:
            raise ValueError(f"cached tokens must be >= 0, got {cached}")
        alone = interpolate(self.prefill_tokens, self.prefill_ms, prompt_tokens)
        if cached == 0:
            return alone / 1e3
        whole = interpolate(self.prefill_tokens, self.prefill_ms, cached + prompt_tokens)
        prefix = interpolate(self.prefill_tokens, self.prefill_ms, cached)
        return max(alone, whole - prefix) / 1e3

    def reused_prefill_s(self, prompt_tokens: int, hit_rate: float) -> float:
        """A prompt's prefill when a prefix cache holds ``hit_rate`` of its tokens (one token
        at least is computed): the rest on top of the cached part (:meth:`prefill_s`)."""
        if not 0 <= hit_rate <= 1:
            raise ValueError(f"a hit rate is in [0, 1], got {hit_rate}")
        cached = min(prompt_tokens - 1, round(prompt_tokens * hit_rate))
        return self.prefill_s(prompt_tokens - cached, cached=cached)

    def decode_s(self, batch: int, context: float) -> float:
        """One token step of ``batch`` sequences holding ``context`` tokens each (mean)."""
        if batch < 1:
            raise ValueError(f"a decode step needs at least one sequence, got {batch}")
        by_batch = [interpolate(self.decode_context, row, context) for row in self.decode_ms]
        return interpolate(self.decode_batch, by_batch, batch) / 1e3

    def decode_increment_s(self, batch: int, context: float) -> float:
        """What ``batch`` token steps add to a step that runs a prompt chunk anyway: their
        step beyond the smallest one measured (batch 1 at the first context), the fixed
        cost of a pass that the chunk's pass already pays (Sarathi-Serve's piggybacking)."""
        smallest = self.decode_s(1, self.decode_context[0])
        return max(0.0, self.decode_s(batch, context) - smallest)

    def mixed_s(self, chunk_tokens: int, cached: int, batch: int, context: float) -> float:
        """One step of prompt chunks (``chunk_tokens`` new tokens on ``cached`` ones) and
        ``batch`` token steps at ``context`` (Sarathi-Serve's model: the chunks' prefill
        at their context plus the token steps' increment); either part may be empty."""
        if batch == 0:
            return self.prefill_s(chunk_tokens, cached)
        if chunk_tokens == 0:
            return self.decode_s(batch, context)
        return self.prefill_s(chunk_tokens, cached) + self.decode_increment_s(batch, context)

    def slowed(self, factor: float) -> EngineProfile:
        """Every time ``factor`` x longer: the engine sharing its cores (Capacity's
        :func:`~orchestrator.planner.capacity.shared_host_slowdown`)."""
        if factor < 1:
            raise ValueError(f"a slowdown is >= 1, got {factor}")
        return replace(self, prefill_ms=tuple(t * factor for t in self.prefill_ms),
                       decode_ms=tuple(tuple(t * factor for t in row) for row in self.decode_ms))

    def max_kv_tokens(self) -> int:
        """Tokens of KV the machine holds at once (Splitwise's token-machine batch limit)."""
        return int(self.kv_memory_bytes // self.kv_bytes_per_token)

    # -- the file ------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "model": self.model,
            "machine": asdict(self.machine),
            "prefill": {"tokens": list(self.prefill_tokens), "ms": list(self.prefill_ms)},
            "decode": {
                "batch": list(self.decode_batch),
                "context": list(self.decode_context),
                "ms": [list(row) for row in self.decode_ms],
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_memory_bytes": self.kv_memory_bytes,
            "source": self.source,
            "license": self.license,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> EngineProfile:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format={d.get('format')!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"profile version {d.get('version')!r} unsupported; want {VERSION}")
        try:
            return cls(
                name=d["name"],
                model=d["model"],
                machine=Machine(**d["machine"]),
                prefill_tokens=tuple(d["prefill"]["tokens"]),
                prefill_ms=tuple(d["prefill"]["ms"]),
                decode_batch=tuple(d["decode"]["batch"]),
                decode_context=tuple(d["decode"]["context"]),
                decode_ms=tuple(tuple(row) for row in d["decode"]["ms"]),
                kv_bytes_per_token=d["kv_bytes_per_token"],
                kv_memory_bytes=d["kv_memory_bytes"],
                source=d["source"],
                license=d.get("license", ""),
                extra=d.get("extra", {}),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed profile: {e!r}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_profile(path_or_name: str | Path) -> EngineProfile:
    """A profile file, or the name of a shipped one (``splitwise-llama2-70b-h100``)."""
    path = Path(path_or_name)
    if not path.exists():
        shipped = SHIPPED / f"{path_or_name}.json"
        if not shipped.exists():
            names = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.json")))
            raise ValueError(f"no profile file {path_or_name!r}; shipped: {names}")
        path = shipped
    return EngineProfile.from_dict(json.loads(path.read_text()))
