"""DejaVu's planner formulas (DESIGN.md §1 "Planner"), as pure functions.

Symbols:
    D    machines available             L    model layers
    M    memory of one machine (bytes)  W0   weights of one layer (bytes)
    C0   prompt KV of one layer for one microbatch (bytes)
    K0   generated-token KV of one layer for one microbatch (bytes)
    Y    prompt time of one microbatch through the whole model (s)
    t    one token step of one microbatch through the whole model (s)
    N    tokens generated per request   m    streaming overhead factor, in [1, 2)

Inverse throughputs are in seconds per D microbatches: the time a colocated
pipeline of depth D, holding D microbatches, needs to serve them all. A prompt
pipeline of depth D_p emits one prompt every m*Y/D_p, so D of them take
I_p = D*m*Y/D_p; a token pipeline of depth D_t holds D_t microbatches for N*t
each, so I_t = D*N*t/D_t. At the balanced split both equal m*Y + N*t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_machines(D: int) -> None:
    if D < 1:
        raise ValueError(f"need at least one machine, got D={D}")


def min_prompt_depth(L: int, W0: float, C0: float, M: float) -> int:
    """D_p >= ceil(L*(C0+W0)/M): a prompt stage holds its layers' weights and prompt KV."""
    if M <= 0:
        raise ValueError(f"machine memory must be positive, got M={M}")
    return max(1, math.ceil(L * (C0 + W0) / M))


def min_token_depth(L: int, W0: float, C0: float, K0: float, M: float) -> int:
    """D_t >= L*W0 / (M - L*(C0+K0)).

    A depth-D_t token pipeline holds D_t microbatches, so every stage keeps the
    KV of its L/D_t layers for all of them (L*(C0+K0) in total) beside its
    L*W0/D_t of weights. A colocated pipeline has the same bound.
    """
    free = M - L * (C0 + K0)
    if free <= 0:
        raise ValueError(
            f"KV of one microbatch over all layers (L*(C0+K0) = {L * (C0 + K0):.4g} B) "
            f"does not fit in one machine's memory M = {M:.4g} B; lower the batch or lengths"
        )
    return max(1, math.ceil(L * W0 / free))


def colocated_inverse_throughput(D: int, Y: float, t: float, N: int) -> float:
    """I_c = (D-1)(Y-t)/D + Y + N*t: one microbatch's life plus the pipeline bubbles."""
    _check_machines(D)
    return (D - 1) * (Y - t) / D + Y + N * t


def prompt_inverse_throughput(D: int, D_p: int, Y: float, m: float) -> float:
    """I_p = D*m*Y/D_p."""
    _check_machines(D)
    if D_p < 1:
        raise ValueError(f"prompt depth must be >= 1, got {D_p}")
    return D * m * Y / D_p


def token_inverse_throughput(D: int, D_t: int, t: float, N: int) -> float:
    """I_t = D*N*t/D_t."""
    _check_machines(D)
    if D_t < 1:
        raise ValueError(f"token depth must be >= 1, got {D_t}")
    return D * N * t / D_t


def disaggregated_inverse_throughput(
    D: int, D_p: int, D_t: int, Y: float, t: float, N: int, m: float
) -> float:
    """I_dis = max(I_p, I_t): the slower pool sets the pace."""
    return max(prompt_inverse_throughput(D, D_p, Y, m), token_inverse_throughput(D, D_t, t, N))


def optimal_split(D: int, Y: float, t: float, N: int, m: float) -> tuple[float, float]:
    """Real-valued (D_p, D_t) with I_p = I_t: D_p = D*m*Y/(m*Y+N*t), D_t = D*N*t/(m*Y+N*t)."""
    _check_machines(D)
    total = m * Y + N * t
    if total <= 0:
        raise ValueError(f"m*Y + N*t must be positive (Y={Y}, t={t}, N={N}, m={m})")
    return D * m * Y / total, D * N * t / total


def disaggregation_threshold(D: int, m: float) -> float:
    """(D-1)/(D*(2-m)-1): disaggregate when Y/t exceeds it; inf when it never pays.

    The inequality comes from I_c > m*Y + N*t. When D*(2-m)-1 <= 0 (m near or
    past 2) the streaming overhead eats every bubble saved: no Y/t suffices.
    """
    _check_machines(D)
    if m < 1:
        raise ValueError(f"streaming overhead factor m must be >= 1, got {m}")
    denominator = D * (2 - m) - 1
    if denominator <= 0:
        return math.inf
    return (D - 1) / denominator


def should_disaggregate(D: int, Y: float, t: float, m: float) -> bool:
    """Y/t > (D-1)/(D*(2-m)-1), the real-valued condition."""
    if t <= 0:
        raise ValueError(f"token step time must be positive, got t={t}")
    return Y / t > disaggregation_threshold(D, m)


@dataclass(frozen=True)
class Split:
    """An integer split of D machines and the inverse throughput it gives."""

    D_p: int
    D_t: int
    I_p: float
    I_t: float

    @property
    def I_dis(self) -> float:
        return max(self.I_p, self.I_t)


def integer_split(
    D: int, Y: float, t: float, N: int, m: float, dp_min: int, dt_min: int
) -> Split:
    """Round the optimal split to D_p + D_t = D within both memory minimums.

    I_dis is the max of a falling and a rising function of D_p, so the best
    integer is the floor or ceiling of the real optimum, clamped to the
    feasible range; evaluate both and keep the faster (the smaller D_p on ties).
    """
    _check_machines(D)
    if dp_min < 1 or dt_min < 1:
        raise ValueError(f"minimum depths must be >= 1, got D_p>={dp_min}, D_t>={dt_min}")
    if dp_min + dt_min > D:
        raise ValueError(
            f"{D} machines cannot hold a prompt pipeline of depth >= {dp_min} "
            f"and a token pipeline of depth >= {dt_min}"
        )
    real_dp, _ = optimal_split(D, Y, t, N, m)
    low, high = dp_min, D - dt_min
    candidates = sorted({min(max(rounded, low), high)
                         for rounded in (math.floor(real_dp), math.ceil(real_dp))})
    splits = [
        Split(dp, D - dp, prompt_inverse_throughput(D, dp, Y, m),
              token_inverse_throughput(D, D - dp, t, N))
        for dp in candidates
    ]
    return min(splits, key=lambda s: s.I_dis)
