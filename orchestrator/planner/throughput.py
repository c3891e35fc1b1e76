"""Sustained throughput of a run: one definition for the bench measuring real tritonservers
and for the serving simulator measuring itself, so that predicted and measured compare
like with like."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def rate_between(stamps: Sequence[float], lo: float = 10, hi: float = 90) -> float:
    """Events per second between the ``lo``-th and ``hi``-th percentile of their times:
    the rate of the middle of a run, without its start-up and its drain."""
    if len(stamps) < 2:
        return math.nan
    a, b = percentile(stamps, lo), percentile(stamps, hi)
    return sum(a <= t <= b for t in stamps) / (b - a) if b > a else math.nan


def sustained_rps(times: Sequence[Sequence[float]], outputs: Sequence[int]) -> float:
    """Requests/s at saturation: the tokens/s of the run's middle (:func:`rate_between` of
    every token streamed, first tokens included) over the mean tokens a request asks for.
    ``times``: each request's [send, token, token, ...]; ``outputs``: the tokens each asks
    for (a request cut short still counts what it asked)."""
    if len(times) != len(outputs) or not outputs:
        raise ValueError("need the times and the output length of each request")
    return rate_between([t for ts in times for t in ts[1:]]) / statistics.fmean(outputs)
