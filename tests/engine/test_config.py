"""``ModelConfig`` from HF ``config.json`` dicts."""

from __future__ import annotations

import pytest

from orchestrator.engine.config import ModelConfig
from orchestrator.layout import StageSpec

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 176,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "eos_token_id": [2, 7],
}


def test_llama_rope_theta_old_and_new_style():
    old = ModelConfig.from_dict({**LLAMA, "rope_theta": 5e5})
    new = ModelConfig.from_dict(
        {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert old == new
    assert (old.rope_theta, old.num_kv_heads, old.head_dim, old.eos_id) == (5e5, 2, 16, 2)
    assert (old.norm, old.gated_mlp, old.has_bias) == ("rmsnorm", True, False)


def test_kv_layout_of_a_stage():
    config = ModelConfig.from_dict(LLAMA)
    layout = config.kv_layout(StageSpec(1, 3, 4), max_seq_len=32, dtype="bfloat16")
    assert layout.shape == (2, 2, 2, 32, 16)
    assert (layout.first_layer, layout.dtype) == (1, "bfloat16")
    with pytest.raises(ValueError, match="stage is of a 6-layer model, not 4"):
        config.kv_layout(StageSpec(0, 1, 6), 32)


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"model_type": "bloom"}, "unsupported model_type 'bloom'"),
        ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
        ({**LLAMA, "attention_bias": True}, "attention/mlp bias"),
        ({**LLAMA, "dtype": "int4"}, "unsupported dtype 'int4'"),
        (
            {
                "model_type": "opt",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "do_layer_norm_before": False,
            },
            "post-norm",
        ),
    ],
)
def test_unsupported_configs_name_what_is_wrong(hf, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(hf)
