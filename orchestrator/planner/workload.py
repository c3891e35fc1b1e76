"""Request streams for the simulator: synthetic, Poisson, or the Azure 2023 traces.

A request's ``output_len`` is its number of token steps after the prompt (the
N of the planner's formulas); a request that stops before the workload's N is
an *early stop*.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

TRACES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
# The Splitwise paper's Azure 2023 traces ship with the package (CC-BY 4.0, see README there).
TRACE_DIR = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float  # seconds from the start of the run
    prompt_len: int
    output_len: int


def load_trace(name: str) -> list[Request]:
    """All requests of one Azure trace, arrivals relative to its first request."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")
    path = TRACE_DIR / TRACES[name]
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    start = min(stamps)
    return [
        Request(i, (s - start).total_seconds(), int(r["ContextTokens"]),
                max(1, int(r["GeneratedTokens"])))
        for i, (s, r) in enumerate(zip(stamps, rows, strict=True))
    ]


def sample(requests: list[Request], count: int, seed: int) -> list[Request]:
    """``count`` requests drawn without replacement, renumbered, original order kept."""
    if not 1 <= count <= len(requests):
        raise ValueError(f"cannot sample {count} of {len(requests)} requests")
    picked = sorted(random.Random(seed).sample(range(len(requests)), count))
    return [replace(requests[i], id=n) for n, i in enumerate(picked)]


def synthetic(
    count: int, prompt_len: int, new_tokens: int, early_stops: bool = False, seed: int = 0
) -> list[Request]:
    """``count`` requests all arriving at 0; with early stops each runs 1..N steps, uniformly."""
    if count < 1 or prompt_len < 1 or new_tokens < 1:
        raise ValueError("count, prompt_len and new_tokens must be >= 1")
    rng = random.Random(seed)
    return [
        Request(i, 0.0, prompt_len, rng.randint(1, new_tokens) if early_stops else new_tokens)
        for i in range(count)
    ]


def poisson(requests: list[Request], rate: float, seed: int) -> list[Request]:
    """The same requests with Poisson arrivals of ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    rng, now, out = random.Random(seed), 0.0, []
    for r in requests:
        out.append(replace(r, arrival=now))
        now += rng.expovariate(rate)
    return out
