"""The torch engine: one pipeline stage of a GPT-2, OPT or Llama model, CPU or CUDA.

Prefill packs the batch's prompts into one ``[sum T_i, hidden]`` tensor for the
linear layers; decode runs one row per sequence. Attention runs per sequence,
in place over that sequence's own KV slot.

Both run under ``no_grad`` rather than ``inference_mode``, so callers may
still write into the tensors they get back (transports, swapping).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from orchestrator.engine.base import LayerHook
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.layers import ACTIVATIONS, apply_rope, norm, rope_table
from orchestrator.engine.weights import Params, StageWeights, load_stage_weights
from orchestrator.layout import DTYPE_BYTES, KVCache, StageSpec, torch_dtype

# (q, k, v) of one layer, each [N, heads, head_dim] -> attention output [N, heads * head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TorchEngine:
    def __init__(
        self,
        config: ModelConfig,
        stage: StageSpec,
        weights: StageWeights,
        device: torch.device,
        dtype: str,
        max_seq_len: int,
    ):
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {config.activation!r}")
        self.config, self.stage, self.weights = config, stage, weights
        self.device, self.dtype = device, torch_dtype(dtype)
        self.kv_layout = config.kv_layout(stage, max_seq_len, dtype)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.act = ACTIVATIONS[config.activation]
        self.rope = (
            rope_table(config.rope_theta, config.head_dim, max_seq_len, device)
            if config.rope_theta is not None
            else None
        )

    @property
    def max_seq_len(self) -> int:
        return self.kv_layout.max_seq_len

    def new_cache(self) -> KVCache:
        return KVCache.empty(self.kv_layout, self.device)

    @torch.no_grad()
    def prefill(
        self,
        inputs: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        on_layer: LayerHook | None = None,
    ) -> list[torch.Tensor]:
        self._check_caches(caches, len(inputs))
        lengths = [len(x) for x in inputs]
        starts = [cache.length for cache in caches]
        for i, (x, start) in enumerate(zip(inputs, starts, strict=True)):
            self._check_input(x, f"prompt {i}")
            if not 0 < len(x) <= self.max_seq_len - start:
                raise ValueError(
                    f"prompt {i} has {len(x)} tokens on {start} cached; "
                    f"need 1..{self.max_seq_len - start}"
                )
        for cache, n in zip(caches, lengths, strict=True):
            cache.length += n  # before the layers, so ``on_layer`` sees how much each layer holds
        positions = torch.cat([
            torch.arange(s, s + n, device=self.device)
            for s, n in zip(starts, lengths, strict=True)
        ])
        x = self._stage_input(torch.cat([x.to(self.device) for x in inputs]), positions)

        for i, w in enumerate(self.weights.layers):
            layer = self.stage.first_layer + i
            attend = self._attend(layer, caches, starts, lengths)
            x = self._block(x, w, positions, attend)
            if on_layer is not None:
                on_layer(layer, caches)

        if not self.stage.is_last:
            return list(x.split(lengths))
        last_rows = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return list(self._logits(x[last_rows]))

    def step(
        self,
        prompts: Sequence[torch.Tensor],
        prompt_caches: Sequence[KVCache],
        inputs: torch.Tensor | None,
        caches: Sequence[KVCache],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        prompt_out = self.prefill(prompts, prompt_caches) if prompts else []
        return prompt_out, None if inputs is None else self.decode(inputs, caches)

    @torch.no_grad()
    def decode(self, inputs: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        self._check_caches(caches, len(inputs))
        self._check_input(inputs, "decode input")
        for i, cache in enumerate(caches):
            if cache.length >= self.max_seq_len:
                raise ValueError(f"cache {i} is full ({self.max_seq_len} positions)")
        starts = [c.length for c in caches]
        positions = torch.tensor(starts, device=self.device)
        x = self._stage_input(inputs.to(self.device), positions)
        for i, w in enumerate(self.weights.layers):
            attend = self._attend(self.stage.first_layer + i, caches, starts, [1] * len(caches))
            x = self._block(x, w, positions, attend)
        for cache in caches:
            cache.length += 1
        return self._logits(x) if self.stage.is_last else x

    # -- the model ---------------------------------------------------------

    def _stage_input(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embed ids on the first stage; later stages receive hidden states."""
        if not self.stage.is_first:
            return x.to(self.dtype)
        h = F.embedding(x, self.weights.embed)
        if self.weights.pos is not None:
            h = h + F.embedding(positions + self.config.position_offset, self.weights.pos)
        return h

    def _block(self, x: torch.Tensor, w: Params, positions: torch.Tensor, attend: Attend):
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = norm(x, w["norm1.weight"], w.get("norm1.bias"), cfg.norm, cfg.norm_eps)
        q, k, v = F.linear(h, w["qkv.weight"], w.get("qkv.bias")).split(
            [q_size, kv_size, kv_size], dim=-1
        )
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.rope is not None:
            cos, sin = self.rope[0][positions], self.rope[1][positions]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + F.linear(attend(q, k, v), w["o.weight"], w.get("o.bias"))

        h = norm(x, w["norm2.weight"], w.get("norm2.bias"), cfg.norm, cfg.norm_eps)
        if cfg.gated_mlp:
            h = self.act(F.linear(h, w["gate.weight"])) * F.linear(h, w["up.weight"])
        else:
            h = self.act(F.linear(h, w["up.weight"], w.get("up.bias")))
        return x + F.linear(h, w["down.weight"], w.get("down.bias"))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        final = self.weights.final_norm
        x = norm(x, final["weight"], final.get("bias"), self.config.norm, self.config.norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    # -- attention over the KV slots ---------------------------------------

    def _attend(
        self, layer: int, caches: Sequence[KVCache], starts: list[int], counts: list[int]
    ) -> Attend:
        """Per sequence: write its ``count`` new K/V rows at ``start`` of its slot, then attend
        over the slot so far, each new row seeing every position up to its own: a whole
        prompt (start 0, causal), a prompt's rest on a cached prefix, or one decode token.
        Attending in place, one sequence at a time, reads no padding and copies no KV, and a
        sequence's result never depends on its batch."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for cache, start, q_i, k_i, v_i in zip(
                caches, starts, q.split(counts), k.split(counts), v.split(counts), strict=True
            ):
                slot, end = cache.layer(layer), start + len(q_i)
                slot[0, :, start:end] = k_i.transpose(0, 1)  # [T, heads, dim] -> [heads, T, dim]
                slot[1, :, start:end] = v_i.transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q_i.transpose(0, 1)[None],
                    slot[None, 0, :, :end],
                    slot[None, 1, :, :end],
                    attn_mask=_causal_on_prefix(start, len(q_i), self.device),
                    is_causal=start == 0 and len(q_i) > 1,
                    enable_gqa=True,
                )
                outs.append(out[0].transpose(0, 1).reshape(len(q_i), -1))
            return torch.cat(outs)

        return attend

    # -- input checks -------------------------------------------------------

    def _check_caches(self, caches: Sequence[KVCache], count: int) -> None:
        if count == 0:
            raise ValueError("empty batch")
        if len(caches) != count:
            raise ValueError(f"{count} inputs but {len(caches)} caches")
        for i, cache in enumerate(caches):
            if cache.layout != self.kv_layout:
                raise ValueError(f"cache {i} has layout {cache.layout}, want {self.kv_layout}")

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        """Ids ``[N]`` on the first stage, hidden states ``[N, hidden]`` elsewhere."""
        if self.stage.is_first:
            if x.dim() != 1 or x.dtype.is_floating_point:
                raise ValueError(
                    f"{what}: first stage takes 1-D token ids, got {x.dtype} {tuple(x.shape)}"
                )
            if len(x) and not 0 <= int(x.min()) <= int(x.max()) < self.vocab_size:
                raise ValueError(f"{what}: token id out of range [0, {self.vocab_size})")
        elif x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(
                f"{what}: stage takes [T, {self.hidden_size}] hidden states, got {tuple(x.shape)}"
            )


def _causal_on_prefix(start: int, count: int, device: torch.device) -> torch.Tensor | None:
    """``[count, start + count]``: new row ``i`` (position ``start + i``) sees positions
    ``0 .. start + i``. None where SDPA's own causal flag (start 0) or no mask (one row)
    says the same: SDPA aligns ``is_causal`` top-left, right only for an empty prefix."""
    if start == 0 or count == 1:
        return None
    rows = torch.arange(count, device=device)[:, None]
    return torch.arange(start + count, device=device)[None, :] <= rows + start


def load_engine(
    model_dir: str | Path,
    stage: StageSpec | None = None,
    device: str | torch.device = "cpu",
    dtype: str | None = None,
    max_seq_len: int | None = None,
) -> TorchEngine:
    """Load one stage (default: the whole model) from a local HF checkpoint folder.

    ``dtype`` defaults to float32 on CPU and to the checkpoint's dtype elsewhere;
    ``max_seq_len`` (the KV slot size) to the model's maximum positions.
    """
    config = ModelConfig.from_dir(model_dir)
    stage = stage or StageSpec.whole(config.num_layers)
    if stage.num_layers != config.num_layers:
        raise ValueError(f"stage {stage} does not fit a {config.num_layers}-layer model")
    device = torch.device(device)
    dtype = dtype or ("float32" if device.type == "cpu" else config.dtype)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    max_seq_len = max_seq_len or config.max_positions
    if config.rope_theta is None and max_seq_len > config.max_positions:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the model's {config.max_positions} positions"
        )
    weights = load_stage_weights(model_dir, config, stage, device, torch_dtype(dtype))
    return TorchEngine(config, stage, weights, device, dtype, max_seq_len)
