"""Next-token choice from logits: greedy by default, or seeded temperature/top-k/top-p,
after the request's logits processors (penalties, ``min_tokens``, bad words).

The random draw for a token depends only on the seed and the token's position, so a
seeded request makes the same tokens whether one process samples them all or a P-node
samples the first and a T-node the rest, and after a T-stage recovery redoes steps.

Log-probs (asked with ``log_probs``) are those of the model's raw distribution: the
log-softmax of the logits the model made, before penalties, masks, temperature or top-k/p
(vLLM's default; TensorRT-LLM reports the processed ones). They are computed only for
the sequences that ask, where each token is sampled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from orchestrator.engine.log_probs import TokenLogProb

_POSITION_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the seed space


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0
    min_tokens: int = 0  # end_id is masked until this many tokens are made
    end_id: int | None = None
    repetition_penalty: float = 1.0  # over prompt and output tokens (divides positive logits)
    presence_penalty: float = 0.0  # over output tokens, once per distinct token
    frequency_penalty: float = 0.0  # over output tokens, per occurrence
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    prompt: tuple[int, ...] = ()  # carried only when the repetition penalty needs it
    made: tuple[int, ...] = ()  # tokens made before this sampler took over
    log_probs: bool = False  # compute each sampled token's log-prob
    top_log_probs: int = 0  # and this many alternatives' (needs log_probs)

    def __post_init__(self) -> None:
        # JSON round trips (pipeline step headers, recovery) give lists back.
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "made", tuple(self.made))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_log_probs < 0:
            raise ValueError(f"top_log_probs must be >= 0, got {self.top_log_probs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_prompt(self, prompt_ids: Sequence[int]) -> SamplingParams:
        """These parameters for one prompt (kept only if the repetition penalty reads it)."""
        return replace(self, prompt=tuple(prompt_ids) if self.repetition_penalty != 1 else ())

    def resumed(self, made: Sequence[int]) -> SamplingParams:
        """For a sampler that takes over after ``made`` tokens (a T-stage after the P-node's
        first token, a stage redoing steps after a recovery)."""
        return replace(self, made=tuple(made))


class Sampler:
    """Picks one token per call for one sequence and remembers it (the penalties and
    ``min_tokens`` read what was made)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.made: list[int] = list(self.params.made)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, vocab]`` logits -> ``[B]`` token ids. Serving gives each sequence its own
        sampler (B = 1); rows of one call share the history, and only B = 1 extends it."""
        p = self.params
        logits = self.process(logits.float())
        tokens = logits.argmax(dim=-1) if p.greedy else self._draw(logits)
        if len(tokens) == 1:
            self.made.append(int(tokens[0]))
        return tokens

    def pick(self, logits: torch.Tensor) -> tuple[int, TokenLogProb | None]:
        """One sequence's ``[1, vocab]`` logits -> its token, and the token's log-prob if
        the request asked for them."""
        token = int(self(logits)[0])
        if not self.params.log_probs:
            return token, None
        return token, token_log_prob(logits[0], token, self.params.top_log_probs)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, then the masks (``min_tokens``, bad words), on ``[B, vocab]`` logits."""
        p = self.params
        logits = logits.clone()
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(p.prompt) | set(self.made)), dtype=torch.long)
            if len(seen):
                values = logits[:, seen]
                logits[:, seen] = torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.made:
            counts = Counter(self.made)
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor(list(counts.values()), dtype=logits.dtype)
            logits[:, ids] -= p.presence_penalty + p.frequency_penalty * n
        if p.end_id is not None and len(self.made) < p.min_tokens:
            logits[:, p.end_id] = float("-inf")
        for word in p.bad_words:
            if len(word) == 1 or tuple(self.made[-(len(word) - 1):]) == word[:-1]:
                logits[:, word[-1]] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        # From the max down: a tiny temperature scales to -inf, never to inf (a NaN softmax).
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
        position_seed = (p.seed * _POSITION_MIX + len(self.made)) % 2**63
        generator = torch.Generator(logits.device).manual_seed(position_seed)
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def token_log_prob(logits: torch.Tensor, token: int, top: int = 0) -> TokenLogProb:
    """``token``'s log-prob under the raw ``[vocab]`` logits, with the ``top`` likeliest."""
    logits = logits.float()
    total = torch.logsumexp(logits, dim=-1)  # log_softmax without a vocab-sized result
    best = logits.topk(top) if top else None
    return TokenLogProb(float(logits[token] - total), () if best is None else tuple(
        zip(best.indices.tolist(), (best.values - total).tolist(), strict=True)))
