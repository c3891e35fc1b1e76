"""The emulated engine: a profile's step times, deterministic tokens, real KV bytes.

Only the compute is replaced. Each prefill or decode sleeps what the profile
(:class:`~orchestrator.profiles.profile.EngineProfile`) says for its actual
batch, prompt tokens and context (a prompt's rest on a cached prefix: the new
tokens at that context; a colocated step of prompt chunks and token steps:
the profile's mixed model, Sarathi-Serve's), times this stage's share of the
layers, so a node costs little CPU and many fit on one machine; the rest of the serving path
(Triton, orchestrator, KV transports, replication, recovery) runs as it is.

Tokens: a sequence's state is a rolling hash of its tokens so far, kept *in its
KV slot* (head 0, dim 0 of every layer's K at each position). The state thus
travels wherever the KV goes (streamed, swapped, replicated, recovered), and the
next token depends on the whole sequence only: token-exact across layouts,
against :func:`emulated_reference`. Hidden states between stages carry
``[token, state]`` in their first two columns.

KV is real bytes in the model config's layout (float32, so the hash is exact);
:attr:`EmulatedEngine.kv_scale` is its size against the profile's KV per token,
the factor every figure from an emulated run must report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from orchestrator.engine.base import LayerHook
from orchestrator.engine.config import ModelConfig
from orchestrator.layout import KVCache, StageSpec
from orchestrator.profiles.profile import EngineProfile

MODULUS = 1 << 24  # float32 holds every integer below it exactly
MULTIPLIER = 1_000_003
LOGIT = 100.0  # the chosen token's logit; every other is 0


def next_state(state: int, token: int) -> int:
    return (state * MULTIPLIER + token + 1) % MODULUS


def token_of(state: int, vocab_size: int) -> int:
    return (state * 2_654_435_761 >> 7) % vocab_size


def emulated_reference(prompt: Sequence[int], new_tokens: int, vocab_size: int) -> list[int]:
    """The greedy tokens the emulated engine generates after ``prompt``, in one process."""
    state = 0
    for token in prompt:
        state = next_state(state, token)
    out = []
    for _ in range(new_tokens):
        out.append(token_of(state, vocab_size))
        state = next_state(state, out[-1])
    return out


class EmulatedEngine:
    def __init__(
        self,
        config: ModelConfig,
        stage: StageSpec,
        profile: EngineProfile,
        max_seq_len: int,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if config.hidden_size < 2 or config.head_dim < 2:
            raise ValueError("the emulated engine keeps [token, state] in hidden states and KV")
        self.config, self.stage, self.profile = config, stage, profile
        self._sleep, self._clock = sleep, clock
        self.kv_layout = config.kv_layout(stage, max_seq_len, "float32")
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.device = torch.device("cpu")
        self.share = stage.count / stage.num_layers  # of the whole model's step time
        # A step sleeps the profile's time x time_scale: slowed K-fold, the serving path's
        # own CPU per step shrinks K-fold against it (the figures divide K back out).
        self.time_scale = time_scale

    @property
    def kv_scale(self) -> float:
        """Bytes this run holds per token (all layers) over the profile's."""
        whole = self.kv_layout.token_bytes_per_layer() * self.stage.num_layers
        return whole / self.profile.kv_bytes_per_token

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.kv_layout, self.device)

    def prefill(
        self,
        inputs: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        on_layer: LayerHook | None = None,
    ) -> list[torch.Tensor]:
        start = self._clock()
        seconds = self.profile.prefill_s(*self._prefill_tokens(inputs, caches))
        return self._prefill(inputs, caches, on_layer, start, seconds * self.share
                             * self.time_scale)

    def step(
        self,
        prompts: Sequence[torch.Tensor],
        prompt_caches: Sequence[KVCache],
        inputs: torch.Tensor | None,
        caches: Sequence[KVCache],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Prompt chunks and token steps as one pass: the profile's
        :meth:`~orchestrator.profiles.profile.EngineProfile.mixed_s`."""
        if not prompts or inputs is None:
            prompt_out = self.prefill(prompts, prompt_caches) if prompts else []
            return prompt_out, None if inputs is None else self.decode(inputs, caches)
        start = self._clock()
        scale = self.share * self.time_scale
        new, cached = self._prefill_tokens(prompts, prompt_caches)
        chunk_s = self.profile.prefill_s(new, cached) * scale
        prompt_out = self._prefill(prompts, prompt_caches, None, start, chunk_s)
        batch, context = self._decode_shape(inputs, caches)
        return prompt_out, self._decode(inputs, caches, start + chunk_s,
                                        self.profile.decode_increment_s(batch, context) * scale)

    def _prefill_tokens(self, inputs: Sequence[torch.Tensor], caches: Sequence[KVCache]
                        ) -> tuple[int, int]:
        """(new tokens, tokens the slots hold) of a checked prefill."""
        self._check(inputs, caches)
        limit = self.kv_layout.max_seq_len
        if any(c.length + len(x) > limit for x, c in zip(inputs, caches, strict=True)):
            raise ValueError(f"a prompt on its cached prefix exceeds the slot ({limit} positions)")
        return sum(len(x) for x in inputs), sum(c.length for c in caches)

    def _prefill(self, inputs: Sequence[torch.Tensor], caches: Sequence[KVCache],
                 on_layer: LayerHook | None, start: float, seconds: float) -> list[torch.Tensor]:
        """Write the prompts' KV layer by layer, done ``seconds`` after ``start``."""
        starts = [c.length for c in caches]
        pairs = [self._pairs(x, c, s) for x, c, s in zip(inputs, caches, starts, strict=True)]
        for cache, x in zip(caches, inputs, strict=True):
            cache.length += len(x)
        for i, layer in enumerate(self.kv_layout.layer_range):  # the hook fires layer by layer
            for cache, p, s in zip(caches, pairs, starts, strict=True):
                cache.layer(layer)[0, 0, s : s + len(p), :2] = p
            self._sleep_until(start + seconds * (i + 1) / self.kv_layout.num_layers)
            if on_layer is not None:
                on_layer(layer, caches)
        if not self.stage.is_last:
            return [self._hidden(p) for p in pairs]
        return [self._logits(p[-1:])[0] for p in pairs]

    def decode(self, inputs: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        start = self._clock()
        seconds = self.profile.decode_s(*self._decode_shape(inputs, caches))
        return self._decode(inputs, caches, start, seconds * self.share * self.time_scale)

    def _decode_shape(self, inputs: torch.Tensor, caches: Sequence[KVCache]
                      ) -> tuple[int, float]:
        """(batch, mean context) of a checked token step."""
        if not len(inputs) or len(inputs) != len(caches):
            raise ValueError(f"{len(inputs)} inputs but {len(caches)} caches")
        self._check_layouts(caches)
        self._check_input(inputs)  # the whole batch at once: its CPU is the T-node's
        if any(c.length >= self.kv_layout.max_seq_len for c in caches):
            raise ValueError(f"a cache is full ({self.kv_layout.max_seq_len} positions)")
        return len(caches), sum(c.length for c in caches) / len(caches) + 1

    def _decode(self, inputs: torch.Tensor, caches: Sequence[KVCache], start: float,
                seconds: float) -> torch.Tensor:
        """One position per sequence, done ``seconds`` after ``start``."""
        if self.stage.is_first:
            rows = []
            for token, cache in zip(inputs.tolist(), caches, strict=True):
                state = int(cache.data[0, 0, 0, cache.length - 1, 1]) if cache.length else 0
                rows.append((token, next_state(state, token)))
            out = torch.tensor(rows, dtype=torch.float32)
        else:
            out = inputs[:, :2].float()
        for cache, pair in zip(caches, out, strict=True):
            cache.data[:, 0, 0, cache.length, :2] = pair  # every layer's K at once
            cache.length += 1
        self._sleep_until(start + seconds)
        return self._logits(out) if self.stage.is_last else self._hidden(out)

    # -- tokens ----------------------------------------------------------------

    def _pairs(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """``[T, 2]`` (token, state after it) for new positions ``start..``: the first stage
        folds ids into the state held at ``start - 1``; later stages receive the pairs."""
        if not self.stage.is_first:
            return x[:, :2].float()
        layer = cache.layer(self.kv_layout.first_layer)
        state = int(layer[0, 0, start - 1, 1]) if start else 0
        rows = []
        for token in x.tolist():
            state = next_state(state, token)
            rows.append((token, state))
        return torch.tensor(rows, dtype=torch.float32)

    def _hidden(self, pairs: torch.Tensor) -> torch.Tensor:
        hidden = torch.zeros(len(pairs), self.hidden_size)
        hidden[:, :2] = pairs
        return hidden

    def _logits(self, pairs: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(pairs), self.vocab_size)
        tokens = [token_of(int(state), self.vocab_size) for state in pairs[:, 1].tolist()]
        logits[torch.arange(len(pairs)), torch.tensor(tokens)] = LOGIT
        return logits

    # -- checks and time -----------------------------------------------------

    def _check(self, inputs: Sequence[torch.Tensor], caches: Sequence[KVCache]) -> None:
        if not inputs:
            raise ValueError("empty batch")
        if len(inputs) != len(caches):
            raise ValueError(f"{len(inputs)} inputs but {len(caches)} caches")
        self._check_layouts(caches)
        limit = self.kv_layout.max_seq_len
        for x in inputs:
            self._check_input(x)
            if not 0 < len(x) <= limit:
                raise ValueError(f"input of {len(x)} positions; need 1..{limit}")

    def _check_layouts(self, caches: Sequence[KVCache]) -> None:
        for cache in caches:
            if cache.layout != self.kv_layout:
                raise ValueError(f"cache layout {cache.layout}, want {self.kv_layout}")

    def _check_input(self, x: torch.Tensor) -> None:
        """Token ids (first stage, 1-D) or hidden states (``[T, hidden]``)."""
        if self.stage.is_first and (x.dim() != 1 or x.dtype.is_floating_point or len(x) and (
                int(x.min()) < 0 or int(x.max()) >= self.vocab_size)):
            raise ValueError(f"first stage takes 1-D token ids in [0, {self.vocab_size})")
        if not self.stage.is_first and (x.dim() != 2 or x.shape[1] != self.hidden_size):
            raise ValueError(f"stage takes [T, {self.hidden_size}] hidden states")

    def _sleep_until(self, deadline: float) -> None:
        left = deadline - self._clock()
        if left > 0:
            self._sleep(left)


def load_emulated_engine(
    model_dir: str, profile: EngineProfile, stage: StageSpec | None = None,
    max_seq_len: int | None = None, time_scale: float = 1.0,
) -> EmulatedEngine:
    """One stage (default: whole model) of the model at ``model_dir``, timed by ``profile``
    (its times x ``time_scale``): the folder gives the shapes (layers, KV heads,
    vocabulary), no weights are read."""
    config = ModelConfig.from_dir(model_dir)
    stage = stage or StageSpec.whole(config.num_layers)
    return EmulatedEngine(config, stage, profile, max_seq_len or config.max_positions,
                          time_scale=time_scale)
