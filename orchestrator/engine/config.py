"""One model description for the three supported families, read from HF ``config.json``.

GPT-2, OPT and Llama differ in names and a few switches (norm kind, position
scheme, MLP shape); :class:`ModelConfig` holds the switches so the engine has
one code path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orchestrator.layout import DTYPE_BYTES, KVLayout, StageSpec

FAMILIES = ("gpt2", "opt", "llama")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # gpt2 | opt | llama
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    activation: str  # HF name: gelu_new, relu, silu, ...
    tie_embeddings: bool
    eos_id: int | None
    dtype: str  # the checkpoint's dtype
    rope_theta: float | None = None  # None: learned absolute positions

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.family == "llama" else "layernorm"

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def has_bias(self) -> bool:
        return self.family != "llama"

    @property
    def position_offset(self) -> int:
        """OPT's learned position table starts at row 2 (a fairseq leftover)."""
        return 2 if self.family == "opt" else 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, hf: dict) -> ModelConfig:
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
        return {"gpt2": _gpt2, "opt": _opt, "llama": _llama}[family](hf)

    def kv_layout(self, stage: StageSpec, max_seq_len: int, dtype: str = "float32") -> KVLayout:
        if stage.num_layers != self.num_layers:
            raise ValueError(f"stage is of a {stage.num_layers}-layer model, not {self.num_layers}")
        return KVLayout(
            stage.count, self.num_kv_heads, self.head_dim, max_seq_len, dtype, stage.first_layer
        )


def _dtype(hf: dict) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_BYTES)}")
    return name


def _eos(hf: dict) -> int | None:
    eos = hf.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


def _require(hf: dict, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"unsupported {hf['model_type']} variant: {what}")


def _common(hf: dict, hidden: int, heads: int) -> dict:
    """The fields every family reads the same way (under its own names for the sizes)."""
    return dict(hidden_size=hidden, num_heads=heads, vocab_size=hf["vocab_size"],
                eos_id=_eos(hf), dtype=_dtype(hf))


def _gpt2(hf: dict) -> ModelConfig:
    _require(hf, hf.get("scale_attn_weights", True), "scale_attn_weights=false")
    _require(hf, not hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        family="gpt2",
        num_layers=hf["n_layer"],
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        max_positions=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation_function", "gelu_new"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        **_common(hf, hidden, heads),
    )


def _opt(hf: dict) -> ModelConfig:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    _require(hf, hf.get("do_layer_norm_before", True), "post-norm (do_layer_norm_before=false)")
    _require(hf, hf.get("word_embed_proj_dim", hidden) == hidden, "word_embed_proj_dim != hidden")
    _require(hf, hf.get("enable_bias", True), "enable_bias=false")
    _require(hf, hf.get("layer_norm_elementwise_affine", True), "non-affine layer norm")
    return ModelConfig(
        family="opt",
        num_layers=hf["num_hidden_layers"],
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=hf["ffn_dim"],
        max_positions=hf["max_position_embeddings"],
        norm_eps=1e-5,  # OPT uses nn.LayerNorm's default
        activation=hf.get("activation_function", "relu"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        **_common(hf, hidden, heads),
    )


def _llama(hf: dict) -> ModelConfig:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    # transformers 5 moved rope settings into ``rope_parameters``; 4.x kept them top-level.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _require(hf, rope_type == "default", f"rope_type {rope_type!r}")
    _require(hf, not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention/mlp bias")
    return ModelConfig(
        family="llama",
        num_layers=hf["num_hidden_layers"],
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=hf["intermediate_size"],
        max_positions=hf["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=hf.get("hidden_act", "silu"),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        **_common(hf, hidden, heads),
    )
