"""Request parameters: defaults, types and the checks that name what is wrong."""

import numpy as np
import pytest

from orchestrator.serving.params import GenerationParams, RequestError, check_prompt


def test_defaults_are_greedy_and_roundtrip_through_tensors():
    params = GenerationParams.from_tensors({"max_tokens": np.array([5], np.int32)})
    assert params.greedy and params.max_tokens == 5 and params.end_id is None
    sampled = GenerationParams(7, end_id=2, temperature=0.75, top_k=4, top_p=0.5, random_seed=3)
    assert GenerationParams.from_tensors(sampled.to_tensors()) == sampled


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({}, "max_tokens is required"),
        ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be at least 1"),
        ({"max_tokens": np.array([1, 2], np.int32)}, "max_tokens must hold one value"),
        ({"max_tokens": np.array([1.5], np.float32)}, "max_tokens must be int32"),
        ({"max_tokens": np.array([4]), "top_p": np.array([0.0], np.float32)}, "top_p"),
        ({"max_tokens": np.array([4]), "temperature": np.array([-1.0], np.float32)}, "temper"),
    ],
)
def test_bad_parameters_are_named(tensors, message):
    with pytest.raises(RequestError, match=message):
        GenerationParams.from_tensors(tensors)


def test_prompt_checks():
    params = GenerationParams(max_tokens=4)
    check_prompt([1, 2, 3], params, max_seq_len=6, vocab_size=10)  # 3 + 4 - 1 = 6 fits
    with pytest.raises(RequestError, match="empty prompt"):
        check_prompt([], params, 6, 10)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        check_prompt([1, 10], params, 6, 10)
    with pytest.raises(RequestError, match="does not fit the context"):
        check_prompt([1] * 7, params, 6, 10)
    with pytest.raises(RequestError, match="exceeds the context"):
        check_prompt([1] * 4, params, 6, 10)
