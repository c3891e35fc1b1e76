"""Load one stage's weights straight from HF safetensors, under family-neutral names.

Each family maps its HF parameter names onto one set of names the engine uses:
``qkv`` (fused, ``[(heads + 2 * kv_heads) * head_dim, hidden]``), ``o``, ``up``,
``down``, ``gate`` (Llama only), ``norm1``, ``norm2``; ``embed``, ``pos``,
``final_norm``, ``lm_head`` outside the blocks. Only the tensors the stage
needs are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from orchestrator.engine.config import ModelConfig
from orchestrator.layout import StageSpec

Params = dict[str, torch.Tensor | None]


@dataclass
class StageWeights:
    layers: list[Params]  # one per layer of the stage
    embed: torch.Tensor | None  # first stage and (tied) last stage
    pos: torch.Tensor | None  # learned positions, first stage only
    final_norm: Params | None  # last stage: {"weight", "bias"}
    lm_head: torch.Tensor | None  # last stage


class _Checkpoint:
    """Tensor lookup by HF name across one or several safetensors files."""

    def __init__(self, model_dir: Path, device: str):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: model_dir / f for name, f in weight_map.items()}
        elif (model_dir / "model.safetensors").is_file():
            single = model_dir / "model.safetensors"
            with safe_open(single, framework="pt") as f:
                files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"no model.safetensors(.index.json) in {model_dir}")
        self.files, self.device = files, device
        self.handles: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        # Base-model exports (GPT2Model, ...) drop the ``transformer.``/``model.`` prefix.
        for key in (name, name.split(".", 1)[1]):
            if key in self.files:
                path = self.files[key]
                if path not in self.handles:
                    self.handles[path] = safe_open(path, framework="pt", device=self.device)
                return self.handles[path].get_tensor(key)
        raise KeyError(f"tensor {name!r} missing from the checkpoint")


def _gpt2_layer(ckpt: _Checkpoint, i: int) -> Params:
    p = f"transformer.h.{i}."

    def conv1d(name: str) -> torch.Tensor:  # Conv1D stores [in, out]
        return ckpt.get(p + name + ".weight").t().contiguous()

    return {
        "norm1.weight": ckpt.get(p + "ln_1.weight"),
        "norm1.bias": ckpt.get(p + "ln_1.bias"),
        "qkv.weight": conv1d("attn.c_attn"),
        "qkv.bias": ckpt.get(p + "attn.c_attn.bias"),
        "o.weight": conv1d("attn.c_proj"),
        "o.bias": ckpt.get(p + "attn.c_proj.bias"),
        "norm2.weight": ckpt.get(p + "ln_2.weight"),
        "norm2.bias": ckpt.get(p + "ln_2.bias"),
        "up.weight": conv1d("mlp.c_fc"),
        "up.bias": ckpt.get(p + "mlp.c_fc.bias"),
        "down.weight": conv1d("mlp.c_proj"),
        "down.bias": ckpt.get(p + "mlp.c_proj.bias"),
    }


def _fused_qkv(ckpt: _Checkpoint, attn: str, suffix: str) -> torch.Tensor:
    return torch.cat([ckpt.get(f"{attn}{x}_proj.{suffix}") for x in "qkv"])


def _opt_layer(ckpt: _Checkpoint, i: int) -> Params:
    p = f"model.decoder.layers.{i}."
    attn = p + "self_attn."
    return {
        "norm1.weight": ckpt.get(p + "self_attn_layer_norm.weight"),
        "norm1.bias": ckpt.get(p + "self_attn_layer_norm.bias"),
        "qkv.weight": _fused_qkv(ckpt, attn, "weight"),
        "qkv.bias": _fused_qkv(ckpt, attn, "bias"),
        "o.weight": ckpt.get(attn + "out_proj.weight"),
        "o.bias": ckpt.get(attn + "out_proj.bias"),
        "norm2.weight": ckpt.get(p + "final_layer_norm.weight"),
        "norm2.bias": ckpt.get(p + "final_layer_norm.bias"),
        "up.weight": ckpt.get(p + "fc1.weight"),
        "up.bias": ckpt.get(p + "fc1.bias"),
        "down.weight": ckpt.get(p + "fc2.weight"),
        "down.bias": ckpt.get(p + "fc2.bias"),
    }


def _llama_layer(ckpt: _Checkpoint, i: int) -> Params:
    p = f"model.layers.{i}."
    return {
        "norm1.weight": ckpt.get(p + "input_layernorm.weight"),
        "qkv.weight": _fused_qkv(ckpt, p + "self_attn.", "weight"),
        "o.weight": ckpt.get(p + "self_attn.o_proj.weight"),
        "norm2.weight": ckpt.get(p + "post_attention_layernorm.weight"),
        "gate.weight": ckpt.get(p + "mlp.gate_proj.weight"),
        "up.weight": ckpt.get(p + "mlp.up_proj.weight"),
        "down.weight": ckpt.get(p + "mlp.down_proj.weight"),
    }


# family -> (layer loader, embed, learned positions, final norm prefix)
_FAMILY: dict[str, tuple[Callable[[_Checkpoint, int], Params], str, str | None, str]] = {
    "gpt2": (_gpt2_layer, "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f"),
    "opt": (
        _opt_layer,
        "model.decoder.embed_tokens.weight",
        "model.decoder.embed_positions.weight",
        "model.decoder.final_layer_norm",
    ),
    "llama": (_llama_layer, "model.embed_tokens.weight", None, "model.norm"),
}


def load_stage_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    stage: StageSpec,
    device: str | torch.device,
    dtype: torch.dtype,
) -> StageWeights:
    ckpt = _Checkpoint(Path(model_dir), str(device))
    load_layer, embed_name, pos_name, norm_prefix = _FAMILY[cfg.family]

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    layers = [
        {k: cast(v) for k, v in load_layer(ckpt, i).items()}
        for i in range(stage.first_layer, stage.last_layer)
    ]
    embed = pos = final_norm = lm_head = None
    if stage.is_first or (stage.is_last and cfg.tie_embeddings):
        embed = cast(ckpt.get(embed_name))
    if stage.is_first and pos_name:
        pos = cast(ckpt.get(pos_name))
    if stage.is_last:
        final_norm = {"weight": cast(ckpt.get(norm_prefix + ".weight"))}
        if cfg.norm == "layernorm":
            final_norm["bias"] = cast(ckpt.get(norm_prefix + ".bias"))
        lm_head = embed if cfg.tie_embeddings else cast(ckpt.get("lm_head.weight"))
        if not stage.is_first:
            embed = None  # only needed as the tied head
    return StageWeights(layers, embed, pos, final_norm, lm_head)
