"""Per-request generation parameters and their checks.

Tensor names follow the TensorRT-LLM backend's ensemble (``max_tokens``,
``end_id``, ``temperature``, ``top_k``, ``top_p``, ``random_seed``, ``stream``)
so the same request reaches every model of the pipeline unchanged. Greedy is
the default; a ``temperature`` above zero turns sampling on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from orchestrator.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as given; the message names what is wrong."""


# name -> numpy dtype of its ``[1]`` tensor
PARAM_TENSORS: dict[str, type] = {
    "max_tokens": np.int32,
    "end_id": np.int32,
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "random_seed": np.uint64,
    "stream": np.bool_,
}


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    end_id: int | None = None
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    random_seed: int | None = None
    stream: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling(self, offset: int = 0) -> SamplingParams:
        """``offset`` keeps the P-node's draw of the first token apart from the T-node's."""
        seed = random.getrandbits(62) if self.random_seed is None else self.random_seed
        return SamplingParams(self.temperature, self.top_k, self.top_p, (seed + offset) % 2**63)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, np.ndarray | None]) -> GenerationParams:
        """Read the ``[1]`` (or ``[1, 1]``) parameter tensors; absent ones take defaults."""
        values = {}
        for name, dtype in PARAM_TENSORS.items():
            array = tensors.get(name)
            if array is None:
                continue
            if array.size != 1:
                raise RequestError(f"{name} must hold one value, got shape {list(array.shape)}")
            if not np.can_cast(array.dtype, dtype, casting="same_kind") and dtype != np.bool_:
                raise RequestError(f"{name} must be {np.dtype(dtype).name}, got {array.dtype}")
            values[name] = array.reshape(-1)[0].item()
        if "max_tokens" not in values:
            raise RequestError("max_tokens is required")
        params = cls(**values)
        params.check()
        return params

    def to_tensors(self) -> dict[str, np.ndarray]:
        tensors = {}
        for name, dtype in PARAM_TENSORS.items():
            value = getattr(self, name)
            if value is not None:
                tensors[name] = np.array([value], dtype=dtype)
        return tensors

    def check(self) -> None:
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")


def check_prompt(
    prompt_ids: list[int], params: GenerationParams, max_seq_len: int, vocab_size: int
) -> None:
    """The prompt must be valid token ids, and it plus every new token must fit a KV slot."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("empty prompt: at least one token is needed")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if n > max_seq_len:
        raise RequestError(f"prompt of {n} tokens does not fit the context of {max_seq_len}")
    # The last new token is returned but never fed back, so it takes no KV position.
    if n + params.max_tokens - 1 > max_seq_len:
        raise RequestError(
            f"prompt of {n} tokens + max_tokens {params.max_tokens} exceeds "
            f"the context of {max_seq_len} tokens"
        )
