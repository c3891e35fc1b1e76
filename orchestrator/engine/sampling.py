"""Next-token choice from logits: greedy by default, or seeded temperature/top-k/top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks one token per row; owns the generator so a seeded run repeats exactly."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, vocab]`` logits -> ``[B]`` token ids."""
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1)
        # From the max down: a tiny temperature scales to -inf, never to inf (a NaN softmax).
        logits = logits.float()
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token when the ones before it already reach top_p; keep the top one.
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        if self.generator is None or self.generator.device != logits.device:
            self.generator = torch.Generator(logits.device).manual_seed(p.seed)
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
