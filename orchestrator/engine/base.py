"""The engine protocol: what a prefill or decode node asks of a model runtime.

An engine owns a contiguous range of layers (a pipeline *stage*). The first
stage embeds token ids, the last normalises and projects to the vocabulary;
stages in between take and return hidden states. KV lives in per-sequence
:class:`~orchestrator.layout.KVCache` slots that the caller owns, so the KV
library can stream, swap and replicate them without the engine knowing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from orchestrator.layout import KVCache, KVLayout, StageSpec

# Called right after layer ``global_layer`` has written its KV for every
# sequence of the batch: the hook that lets a P-node stream layer l while
# layer l+1 computes.
LayerHook = Callable[[int, Sequence[KVCache]], None]


class Engine(Protocol):
    """A model runtime for one stage.

    ``prefill`` and ``decode`` take a batch of sequences, each with its own KV
    slot. Inputs are token ids on the first stage and hidden states elsewhere;
    outputs are logits on the last stage and hidden states elsewhere.
    """

    stage: StageSpec
    kv_layout: KVLayout  # the layout of this stage's slots
    hidden_size: int
    vocab_size: int
    device: torch.device

    def new_cache(self) -> KVCache:
        """An empty KV slot for one sequence on this stage."""
        ...

    def prefill(
        self,
        inputs: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        on_layer: LayerHook | None = None,
    ) -> list[torch.Tensor]:
        """Run prompts on top of what each slot already holds.

        ``inputs[i]`` is ``[T_i]`` ids or ``[T_i, hidden]``: the *new* positions
        ``caches[i].length ..`` of sequence ``i``, whose slot may already hold a
        prefix (a prefix-cache hit, an earlier chunk); they attend to the whole
        context. Returns per sequence ``[T_i, hidden]`` hidden states of the new
        positions, or on the last stage ``[vocab]`` logits of the last position.
        Each cache's ``length`` grows by ``T_i``; ``on_layer`` sees the grown
        length. An empty slot is a whole prompt.
        """
        ...

    def step(
        self,
        prompts: Sequence[torch.Tensor],
        prompt_caches: Sequence[KVCache],
        inputs: torch.Tensor | None,
        caches: Sequence[KVCache],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """One colocated step: :meth:`prefill` of ``prompts`` (whole or chunks, on what
        their slots hold) and :meth:`decode` of ``inputs`` (None: no token step), with
        their outputs; either part may be empty. An engine may run them as one batch."""
        ...

    def decode(self, inputs: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        """One token step. ``inputs`` is ``[B]`` ids or ``[B, hidden]``.

        Returns ``[B, hidden]`` or, on the last stage, ``[B, vocab]`` logits.
        Each cache grows by one position.
        """
        ...
