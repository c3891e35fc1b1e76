"""The reference generate loop: EOS handling, batch membership, sampling, bad input."""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages
from orchestrator.engine.sampling import Sampler, SamplingParams

PROMPTS = [[5, 17, 300, 42], [77], [12, 256, 31, 9, 500, 123, 44]]


@pytest.fixture(scope="module")
def opt_engines(tiny_model):
    return load_stages(tiny_model("opt"), 2)


def test_eos_stops_only_its_sequence(opt_engines):
    full = generate(opt_engines, PROMPTS, 12)
    eos = next(t for t in full[0] if t not in full[1])  # call a token of output 0 "EOS"
    stopped = generate(opt_engines, PROMPTS, 12, eos_id=eos)
    for want, got in zip(full, stopped, strict=True):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    assert len(stopped[0]) < 12 and len(stopped[1]) == 12


def test_max_tokens_one_is_prefill_only(opt_engines):
    assert generate(opt_engines, PROMPTS, 1) == [
        out[:1] for out in generate(opt_engines, PROMPTS, 3)
    ]


def test_seeded_sampling_repeats_and_differs_from_greedy(opt_engines):
    hot = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=7)
    first = generate(opt_engines, PROMPTS, 12, sampling=hot)
    assert generate(opt_engines, PROMPTS, 12, sampling=hot) == first
    assert first != generate(opt_engines, PROMPTS, 12)


def test_sampled_tokens_do_not_depend_on_batch_neighbours(opt_engines):
    hot = SamplingParams(temperature=1.0, seed=3)
    together = generate(opt_engines, PROMPTS, 8, sampling=hot)
    alone = [generate(opt_engines, [p], 8, sampling=hot)[0] for p in PROMPTS]
    assert together == alone


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(Sampler(SamplingParams(temperature=2.0, top_k=1))(logits), greedy)
    assert torch.equal(Sampler(SamplingParams(temperature=2.0, top_p=1e-6))(logits), greedy)


def test_top_k_samples_only_the_k_best():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)).repeat(500, 1)
    sampled = Sampler(SamplingParams(temperature=5.0, top_k=3))(logits)
    assert set(sampled.tolist()) == set(logits[0].topk(3).indices.tolist())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_generate_input(opt_engines):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(opt_engines, [[1], []], 4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        generate(opt_engines, [[1]], 0)
    with pytest.raises(ValueError, match="prompt 0: 250 tokens \\+ 8 new exceed max_seq_len 256"):
        generate(opt_engines, [[1] * 250], 8)
    with pytest.raises(ValueError, match="no engines"):
        generate([], [[1]], 4)
