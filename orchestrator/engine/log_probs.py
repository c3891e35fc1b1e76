"""Per-token log-probs as they travel with the tokens (no torch: the API process reads them).

Each node hop carries them as JSON (floats round-trip exactly), only for requests that
asked; :func:`response_tensors` turns them into the TensorRT-LLM backend's outputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogProb:
    """A sampled token's log-prob and the ``top`` most likely tokens' (id, log-prob),
    most likely first."""

    log_prob: float
    top: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "top", tuple((int(i), float(p)) for i, p in self.top))

    def to_list(self) -> list:
        """JSON form: ``[log_prob, [[id, log_prob], ...]]``."""
        return [self.log_prob, [list(t) for t in self.top]]

    @classmethod
    def from_list(cls, value: Sequence) -> TokenLogProb:
        return cls(float(value[0]), tuple(tuple(t) for t in value[1]))


def encode(log_probs: Sequence[TokenLogProb]) -> bytes:
    return json.dumps([p.to_list() for p in log_probs]).encode()


def decode(data: bytes | str) -> list[TokenLogProb]:
    return [TokenLogProb.from_list(p) for p in json.loads(data)]


def response_tensors(log_probs: Sequence[TokenLogProb], cum_log_prob: float,
                     top: int) -> dict[str, np.ndarray]:
    """One response's outputs, batch and beam dims first as the backend's ensemble has
    them: ``cum_log_probs`` [1, 1] (every token so far), ``output_log_probs`` [1, 1, n]
    (this response's n tokens), and with ``top`` > 0 this project's
    ``output_top_log_probs`` / ``output_top_log_prob_ids`` [1, 1, n, top]."""
    n = len(log_probs)
    out = {"cum_log_probs": np.array([[cum_log_prob]], np.float32),
           "output_log_probs": np.array([[[p.log_prob for p in log_probs]]], np.float32)
           .reshape(1, 1, n)}
    if top:
        pairs = np.array([[list(t) for t in p.top] for p in log_probs], np.float64
                         ).reshape(n, top, 2)
        out["output_top_log_probs"] = pairs[..., 1].astype(np.float32).reshape(1, 1, n, top)
        out["output_top_log_prob_ids"] = pairs[..., 0].astype(np.int32).reshape(1, 1, n, top)
    return out
