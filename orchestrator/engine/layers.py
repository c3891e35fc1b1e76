"""The stateless math of a transformer block, shared by the three families."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float):
    if kind == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    # RMSNorm as Llama computes it: in float32, cast back before the scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_table(theta: float, head_dim: int, max_seq_len: int, device: torch.device):
    """``(cos, sin)``, each ``[max_seq_len, head_dim]`` in float32 (Llama's default RoPE)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    )
    freqs = torch.arange(max_seq_len, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` by per-row ``cos``/``sin`` ``[N, head_dim]``."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
