"""Request parameters: defaults, types, the backend's whole input list (honoured, neutral
only, refused) and the checks that name the input and the value."""

import re
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.serving.params import (
    HONOURED,
    INPUTS,
    NEUTRAL,
    REFUSED,
    GenerationParams,
    RequestError,
    check_prompt,
    parse_words,
)

REPO = Path(__file__).resolve().parents[2]


def batch(**values) -> dict[str, np.ndarray]:
    """[batch, 1] tensors as a TensorRT-LLM client sends them (one row)."""
    return {k: v if isinstance(v, np.ndarray) else np.array([[v]]) for k, v in values.items()}


def test_defaults_are_greedy_and_roundtrip_through_json():
    params = GenerationParams.from_tensors(batch(max_tokens=np.array([[5]], np.int32)), row=0)
    assert params.greedy and params.max_tokens == 5 and params.end_id is None
    sampled = GenerationParams(7, end_id=2, temperature=0.75, top_k=4, top_p=0.5, seed=3,
                               min_tokens=2, stop_words=((1, 2),), bad_words=((5,),))
    assert GenerationParams.from_json(sampled.to_json()) == sampled


@pytest.mark.parametrize(
    ("values", "greedy"),
    [
        ({}, True),
        ({"temperature": 1.0}, True),  # a TensorRT-LLM client's defaults: greedy
        ({"temperature": 0.7, "top_k": 1}, True),  # top-1 is greedy
        ({"temperature": 1.3, "top_k": 0, "top_p": 0.0}, True),  # 0: unset
        ({"top_k": 2}, False),
        ({"temperature": 0.7, "top_p": 0.5}, False),
        ({"temperature": 0.0, "top_k": 40}, True),  # a zero temperature stays greedy
    ],
)
def test_tensorrt_llm_sampling_rule(values, greedy):
    """Greedy unless top_k > 1 or top_p > 0; the temperature applies only when sampling."""
    tensors = {k: np.array([[v]], np.int32 if k == "top_k" else np.float32)
               for k, v in values.items()}
    params = GenerationParams.from_tensors({"max_tokens": np.array([[4]], np.int32),
                                            **tensors}, row=0)
    assert params.greedy == greedy
    if greedy:
        assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 1.0)
    else:
        assert params.temperature == pytest.approx(values.get("temperature", 1.0))
        assert params.top_k == values.get("top_k", 0)
        assert params.top_p == pytest.approx(values.get("top_p", 0.0) or 1.0)


def test_openai_parameters_keep_openai_semantics():
    """The OpenAI server builds GenerationParams itself: temperature alone samples."""
    assert GenerationParams(4).greedy and GenerationParams(4, temperature=0.0).greedy
    assert not GenerationParams(4, temperature=1.0).greedy


def test_seeded_sampling_repeats_and_seeds_differ():
    """A seed fixes the sampler's draws: the same seed the same tokens, another seed others."""
    import torch

    from orchestrator.engine.sampling import Sampler

    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        params = GenerationParams.from_tensors(
            {"max_tokens": np.array([[4]], np.int32), "top_k": np.array([[50]], np.int32),
             "temperature": np.array([[1.0]], np.float32),
             "seed": np.array([[seed]], np.uint64)}, row=0)
        sampler = Sampler(params.sampling([1, 2, 3]))
        return [int(sampler(logits)[0]) for _ in range(12)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_rows_are_read_apart_and_aliases_agree():
    tensors = {"max_tokens": np.array([[4], [9]], np.int32),
               "random_seed": np.array([[7], [8]], np.uint64),
               "min_length": np.array([[1], [2]], np.int32)}
    rows = [GenerationParams.from_tensors(tensors, row) for row in (0, 1)]
    assert [(p.max_tokens, p.seed, p.min_tokens) for p in rows] == [(4, 7, 1), (9, 8, 2)]
    with pytest.raises(RequestError, match="random_seed 7 and seed 8 disagree"):
        GenerationParams.from_tensors(batch(max_tokens=4, random_seed=np.array([[7]], np.uint64),
                                            seed=np.array([[8]], np.uint64)), 0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "max_tokens is required"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": np.array([[1, 2]], np.int32)}, "max_tokens must hold one value"),
        ({"max_tokens": np.array([[1.5]], np.float32)}, "max_tokens must be int"),
        ({"max_tokens": 4, "top_p": np.array([[1.5]], np.float32)},
         r"top_p must be in \[0, 1\], got 1.5"),
        ({"max_tokens": 4, "top_k": np.array([[-1]], np.int32)}, "top_k must be >= 0, got -1"),
        ({"max_tokens": 4, "temperature": np.array([[np.nan]], np.float32)},
         "temperature must be a finite number, got nan"),
        ({"max_tokens": 4, "temperature": np.array([[np.inf]], np.float32)}, "temperature"),
        ({"max_tokens": 4, "temperature": np.array([[-1.0]], np.float32)}, "temperature must"),
        ({"max_tokens": 4, "repetition_penalty": np.array([[0.0]], np.float32)},
         "repetition_penalty must be > 0"),
        ({"max_tokens": 4, "presence_penalty": np.array([[np.nan]], np.float32)},
         "presence_penalty must be a finite"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, max_tokens 4\], got 5"),
        ({"max_tokens": 4, "num_return_sequences": 0}, "num_return_sequences must be in"),
        ({"max_tokens": 4, "beam_width": 4}, "beam_width 4 is not supported: only 1"),
        ({"max_tokens": 4, "return_generation_logits": True}, "return_generation_logits True"),
        ({"max_tokens": 4, "return_context_logits": True}, "return_context_logits True"),
        ({"max_tokens": 4, "lora_task_id": np.array([[3]], np.uint64)},
         r"lora_task_id \(3\) is refused: LoRA adapters are not supported"),
        ({"max_tokens": 4, "prompt_embedding_table": np.ones((1, 2, 2), np.float16)},
         "prompt_embedding_table .* prompt tables"),
        ({"max_tokens": 4, "guided_decoding_guide_type": np.array([[b"json"]], object)},
         r"guided_decoding_guide_type \(b'json'\) is refused: guided decoding"),
        ({"max_tokens": 4, "return_log_probs": True, "top_log_probs": 6},
         r"top_log_probs must be in \[0, 5\], got 6"),
        ({"max_tokens": 4, "top_log_probs": 2}, "top_log_probs 2 needs return_log_probs true"),
        ({"max_tokens": 4, "cache_salt": np.array([[b"x" * 257]], object)},
         "cache_salt must be a string of at most 256 bytes"),
        ({"max_tokens": 4, "cache_salt": np.array([[b"\xff"]], object)}, "cache_salt is not UTF-8"),
        ({"max_tokens": 4, "cache_salt": np.array([[3]], np.int32)}, "cache_salt must be str"),
    ],
)
def test_bad_parameters_are_named(values, message):
    with pytest.raises(RequestError, match=message):
        GenerationParams.from_tensors(batch(**values), row=0)


def test_a_cache_salt_is_read_and_travels_in_json():
    params = GenerationParams.from_tensors(
        batch(max_tokens=4, cache_salt=np.array([[b"tenant-a"]], object)), row=0)
    assert params.cache_salt == "tenant-a"
    assert GenerationParams.from_json(params.to_json()).cache_salt == "tenant-a"


def test_neutral_values_pass_silently():
    params = GenerationParams.from_tensors(batch(
        max_tokens=4, beam_width=1, length_penalty=np.array([[1.0]], np.float32),
        return_context_logits=False, return_generation_logits=False,
        exclude_input_in_output=True, end_id=-1, pad_id=-1,
        embedding_bias_words=np.array([[b""]], object),
        guided_decoding_guide=np.array([[b""]], object)), row=0)
    assert params == GenerationParams(4, exclude_input_in_output=True)


@pytest.mark.parametrize(("values", "message"), [
    ([b"w"] * 2_000_000, "2000000 values, at most 64"),  # counted before any is parsed
    ([b"x" * 1_000_000], "1000000 bytes, at most 16384"),  # before csv's own field limit
    ([b"a," * 100], "100 words, at most 64"),
    ([b"a\nb"], "not comma-separated words"),  # csv refuses a newline outside quotes
    (["\ud800"], "not UTF-8"),  # a lone surrogate
    ([b"\xff"], "not UTF-8"),
])
def test_hostile_stop_and_bad_words_are_refused_before_parsing(values, message):
    start = time.monotonic()
    with pytest.raises(RequestError, match=message):
        parse_words(values)
    assert time.monotonic() - start < 1.0


def test_stop_and_bad_words_take_the_backend_string_form():
    assert parse_words([b"foo", b"bar,baz", b"", b'"a,b",c']) == ["foo", "bar", "baz", "a,b", "c"]
    params = GenerationParams.from_tensors(
        batch(max_tokens=4, stop_ids=np.array([[b"[[1, 2], []]"]], object)), 0)
    assert params.stop_words == ((1, 2),)


def test_every_input_of_the_configs_is_classified():
    """The ensemble, the orchestrator and tensorrt_llm_bls declare exactly the inputs
    params.py knows; nothing is silently ignored."""
    known = set(HONOURED) | set(NEUTRAL) | set(REFUSED)
    for entry in ("ensemble", "tensorrt_llm_bls"):
        config = (REPO / f"model_repository/{entry}/config.pbtxt").read_text()
        declared = set(re.findall(r'\{ name: "(\w+)"', config.split("output [")[0]))
        assert declared - {"text_input", "stop_words", "bad_words"} == known, entry
    orchestrator = (REPO / "model_repository/orchestrator/config.pbtxt").read_text()
    declared = set(re.findall(r'\{ name: "(\w+)"', orchestrator.split("output [")[0]))
    assert declared == set(INPUTS) | {"input_ids", "input_lengths", "input_auth"}


def test_only_the_prompt_is_a_required_input():
    """Triton 2.51 answers a request missing a required ensemble input with HTTP 200 and an
    error text (an empty 200 on generate_stream; a gRPC stream waits): every other input is
    optional, so params.py refuses a missing max_tokens with an error that names it."""
    required = {"ensemble": {"text_input"}, "tensorrt_llm_bls": {"text_input"},
                "orchestrator": {"input_ids", "input_lengths"}}
    for entry, prompt in required.items():
        config = (REPO / f"model_repository/{entry}/config.pbtxt").read_text()
        inputs = re.findall(r'\{ name: "(\w+)"([^}]*)\}', config.split("output [")[0])
        assert {name for name, rest in inputs if "optional: true" not in rest} == prompt, entry


def test_prompt_checks():
    params = GenerationParams(max_tokens=4)
    check_prompt([1, 2, 3], params, max_seq_len=6, vocab_size=10)  # 3 + 4 - 1 = 6 fits
    with pytest.raises(RequestError, match="empty prompt"):
        check_prompt([], params, 6, 10)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        check_prompt([1, 10], params, 6, 10)
    with pytest.raises(RequestError, match="end_id 10 outside the vocabulary"):
        check_prompt([1], GenerationParams(4, end_id=10), 6, 10)
    with pytest.raises(RequestError, match="pad_id 12 outside the vocabulary"):
        check_prompt([1], GenerationParams(4, pad_id=12), 6, 10)
    with pytest.raises(RequestError, match="does not fit the context"):
        check_prompt([1] * 7, params, 6, 10)
    with pytest.raises(RequestError, match="exceeds the context"):
        check_prompt([1] * 4, params, 6, 10)
