"""Dummy checkpoints: HF-compatible folders with seeded random weights (``dejavu model make``).

Like vLLM's ``--load-format dummy``, but written to disk through ``transformers``
itself, so HF and our engine load the very same file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.engine.tokenizer import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    save_tokenizer,
    train_tokenizer,
)

# HF config kwargs per (arch, preset). ``tiny`` is for tests; ``small`` and ``medium`` are
# GPT-2-small / -medium scale (OPT-125m / -350m without its 512-wide embedding projection,
# which the engine does not implement; Llama-shaped at the same widths, with GQA).
PRESETS: dict[str, dict[str, dict]] = {
    "gpt2": {
        "tiny": dict(n_layer=4, n_embd=64, n_head=4, n_inner=256, n_positions=256, vocab_size=512),
        "small": dict(
            n_layer=12, n_embd=768, n_head=12, n_inner=3072, n_positions=1024, vocab_size=50257
        ),
        "medium": dict(
            n_layer=24, n_embd=1024, n_head=16, n_inner=4096, n_positions=1024, vocab_size=50257
        ),
    },
    "opt": {
        "tiny": dict(
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=256,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            vocab_size=512,
        ),
        "small": dict(
            num_hidden_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            ffn_dim=3072,
            max_position_embeddings=2048,
            word_embed_proj_dim=768,
            vocab_size=50272,
        ),
        "medium": dict(
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            ffn_dim=4096,
            max_position_embeddings=2048,
            word_embed_proj_dim=1024,
            vocab_size=50272,
        ),
    },
    "llama": {
        "tiny": dict(
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
            max_position_embeddings=256,
            vocab_size=512,
        ),
        "small": dict(
            num_hidden_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
            max_position_embeddings=2048,
            vocab_size=32000,
        ),
        "medium": dict(
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=2816,
            max_position_embeddings=2048,
            vocab_size=32000,
        ),
    },
}

# The HF config kwarg that counts each architecture's layers.
LAYERS_KEY = {"gpt2": "n_layer", "opt": "num_hidden_layers", "llama": "num_hidden_layers"}

# Weight init std. HF's 0.02 makes a tiny random model repeat one token whatever the
# context; a wider init keeps its greedy output context-dependent, so token-exact tests
# actually exercise attention, positions and the KV cache.
INIT_STD = {"tiny": 0.2, "small": 0.02, "medium": 0.02}

# The tokenizer's own size: the corpus is small, and extra model rows stay unused.
TOKENIZER_VOCAB = 512


def hf_config(arch: str, preset: str, **overrides):
    """The HF config object of a preset (``overrides``: HF config kwargs that replace the
    preset's, e.g. more layers), with our special-token ids and init std."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(
            f"unknown preset {preset!r} for {arch}; choose from {', '.join(PRESETS[arch])}"
        )
    config_class = {"gpt2": GPT2Config, "opt": OPTConfig, "llama": LlamaConfig}[arch]
    ids = dict(
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    init_key = "init_std" if arch == "opt" else "initializer_range"
    shape = {**PRESETS[arch][preset], **overrides}
    return config_class(**shape, **ids, **{init_key: INIT_STD[preset]})


def make_checkpoint(arch: str, preset: str, out_dir: str | Path, seed: int = 0,
                    **overrides) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer into ``out_dir``
    (``overrides``: see :func:`hf_config`)."""
    config = hf_config(arch, preset, **overrides)  # validates before anything is written
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer = train_tokenizer(min(TOKENIZER_VOCAB, config.vocab_size))
    save_tokenizer(tokenizer, out, config.max_position_embeddings)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dejavu model make", description="write a dummy (random-weight) checkpoint folder"
    )
    parser.add_argument("--arch", required=True, choices=sorted(PRESETS))
    parser.add_argument("--preset", required=True, help=" / ".join(INIT_STD))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int,
                        help="layers instead of the preset's (e.g. a tiny model deep enough "
                        "for 12-stage pipelines on the emulated engine)")
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    layers = {} if args.layers is None else {LAYERS_KEY[args.arch]: args.layers}
    try:
        out = make_checkpoint(args.arch, args.preset, args.dir, args.seed, **layers)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {args.arch}/{args.preset} checkpoint to {out}")
    return 0
