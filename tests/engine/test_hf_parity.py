"""Token-exact against Hugging Face ``transformers`` greedy generate on the same folder."""

from __future__ import annotations

import functools

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages

ARCHS = ["gpt2", "opt", "llama"]
NEW_TOKENS = 16
PROMPTS = [
    [5, 17, 300, 42, 8, 99, 250, 11, 61, 7, 400, 3],
    [77],
    [12, 256, 31, 9, 500, 123, 44],
    [300, 301, 302, 303, 304],
]


@functools.cache
def hf_greedy(model_dir: str) -> list[list[int]]:
    """HF generate, one unpadded prompt at a time, EOS disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in PROMPTS:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_matches_hf(tiny_model, arch, depth):
    model_dir = tiny_model(arch)
    expected = hf_greedy(str(model_dir))
    assert len({t for out in expected for t in out}) > 8, "degenerate reference output"
    assert generate(load_stages(model_dir, depth), PROMPTS, NEW_TOKENS) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompt_matches_hf(tiny_model, arch):
    model_dir = tiny_model(arch)
    expected = hf_greedy(str(model_dir))
    engines = load_stages(model_dir, 2)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert generate(engines, [prompt], NEW_TOKENS) == [want]
