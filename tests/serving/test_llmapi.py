"""The LLM-API model's requests read and answered (orchestrator.serving.llmapi), without
Triton: every input of the published config is read or refused by name, SamplingParams'
defaults, stop requests by request id, the responses' outputs."""

from __future__ import annotations

import numpy as np
import pytest
from test_trtllm_contract import HERE, load

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.llmapi import (
    DEFAULT_MAX_TOKENS,
    INPUTS,
    LlmapiReply,
    StopRegistry,
    is_stop,
    read_request,
)
from orchestrator.serving.outputs import kv_cache_use
from orchestrator.serving.params import GenerationParams, RequestError

PUBLISHED = load(HERE / "trtllm_contract" / "llmapi" / "tensorrt_llm.pbtxt")


def read(parameters: dict | None = None, **inputs) -> object:
    tensors = {"text_input": np.array([b"Hello"], object)} | {
        k: np.asarray(v) for k, v in inputs.items()}
    return read_request(tensors, parameters or {})


def test_every_published_input_is_read():
    assert set(INPUTS) == {t.name for t in PUBLISHED.input}


def test_an_unset_request_is_samplingparams_default_greedy_and_32_tokens():
    request = read()
    params = GenerationParams.from_tensors(request.tensors, 0)
    assert params.max_tokens == DEFAULT_MAX_TOKENS == 32
    assert params.greedy and not params.stream and not params.exclude_input_in_output
    assert request.outputs == frozenset() and request.stop == () and request.prompt == "Hello"


def test_sampling_params_reach_the_generation_params():
    request = read(sampling_param_temperature=np.array([0.7], np.float32),
                   sampling_param_top_k=np.array([5], np.int32),
                   sampling_param_top_p=np.array([0.5], np.float32),
                   sampling_param_seed=np.array([9], np.uint64),
                   sampling_param_presence_penalty=np.array([0.2], np.float32),
                   sampling_param_frequency_penalty=np.array([0.3], np.float32),
                   sampling_param_max_tokens=np.array([7], np.int32),
                   sampling_param_exclude_input_from_output=np.array([True]),
                   sampling_param_return_perf_metrics=np.array([True]),
                   sampling_param_best_of=np.array([1], np.int32),
                   return_cumulative_logprob=np.array([True]),
                   return_finish_reason=np.array([True]))
    params = GenerationParams.from_tensors(request.tensors, 0)
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (
        pytest.approx(0.7), 5, 9, 7)
    assert params.top_p == pytest.approx(0.5) and params.presence_penalty == pytest.approx(0.2)
    assert params.exclude_input_in_output and params.return_perf_metrics
    assert params.return_log_probs  # for cumulative_logprob
    assert request.outputs == {"cumulative_logprob", "finish_reason"}
    # a temperature without top_k > 1 or top_p > 0 is greedy, as SamplingParams decides
    greedy = read(sampling_param_temperature=np.array([0.7], np.float32))
    assert GenerationParams.from_tensors(greedy.tensors, 0).greedy


def test_streaming_comes_from_the_input_or_the_request_parameter():
    assert not read().streaming
    assert read(streaming=np.array([True])).streaming
    assert read({"Streaming": True}).streaming
    with pytest.raises(RequestError, match="Streaming must be a bool"):
        read({"Streaming": "yes"})


@pytest.mark.parametrize(("name", "value", "message"), [
    ("lora_id", np.array([0], np.uint64), "lora_id .* LoRA adapters"),
    ("lora_name", np.array([b"a"], object), "lora_name .* LoRA adapters"),
    ("lora_path", np.array([b"/a"], object), "lora_path .* LoRA adapters"),
    ("lora_ckpt_source", np.array([b"hf"], object), "lora_ckpt_source .* LoRA adapters"),
    ("image_url", np.array([b"https://x/a.png"], object), "image_url .* multimodal"),
    ("sampling_param_best_of", np.array([2], np.int32), "sampling_param_best_of 2"),
    ("text_input", np.array([b"a", b"b"], object), "text_input holds 2 prompts"),
])
def test_what_it_cannot_serve_is_refused_by_name(name, value, message):
    with pytest.raises(RequestError, match=message):
        read(**{name: value})


def test_stop_strings_are_each_one_string():
    request = read(sampling_param_stop=np.array([b"a, b", b"", "c"], object))
    assert request.stop == ("a, b", "c")


def test_a_stop_ends_every_running_request_of_its_id():
    stops = StopRegistry()
    first, second, other = stops.register("7"), stops.register("7"), stops.register("8")
    assert is_stop({"stop": np.array([True])}) and not is_stop({"stop": np.array([False])})
    assert stops.stop("7") == 2
    assert first.is_set() and second.is_set() and not other.is_set()
    stops.unregister("7", first)
    stops.unregister("7", second)
    assert stops.stop("7") == 0 and "7" not in stops.running
    with pytest.raises(RequestError, match="request id must be provided"):
        stops.stop("")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model("llama"))


def perf_meta(full_text: bool) -> dict:
    return {"full_text": full_text, "log_probs": {"cum": -1.5},
            "perf": {"arrival_time_ns": 1, "first_scheduled_time_ns": 2,
                     "first_token_time_ns": 3, "last_token_time_ns": 4,
                     **kv_cache_use(5, 0, 32)}}


def test_a_streamed_reply_carries_the_text_so_far_and_ends_with_its_reasons(tokenizer):
    prompt = tokenizer.encode("Hello there").ids
    new = tokenizer.encode("general kenobi", add_special_tokens=False).ids
    request = read({"Streaming": True}, return_finish_reason=np.array([True]),
                   return_stop_reason=np.array([True]), return_cumulative_logprob=np.array([True]),
                   sampling_param_return_perf_metrics=np.array([True]))
    reply = LlmapiReply(tokenizer, end_id=2)
    reply.start(request, prompt, [])
    first = reply.respond(new[:1], perf_meta(False), final=False)
    assert first["text_output"][0].decode() == tokenizer.decode(new[:1], skip_special_tokens=True)
    assert first["finish_reason"][0] == b"None" and first["stop_reason"][0] == b"None"
    last = reply.respond(new[1:] + [2], perf_meta(False), final=True)
    assert last["text_output"][0].decode() == tokenizer.decode(new, skip_special_tokens=True)
    assert last["finish_reason"][0] == b"stop"  # the end token
    assert last["cumulative_logprob"][0] == np.float32(-1.5)
    assert (last["kv_cache_missed_block"][0], last["kv_cache_hit_rate"][0]) == (1, 0.0)


def test_a_unary_reply_holds_the_prompt_and_cuts_a_stop_string(tokenizer):
    prompt = tokenizer.encode("Hello there").ids
    stop_id = next(t for t in range(100, tokenizer.get_vocab_size())
                   if tokenizer.decode([t]).strip()
                   and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False).ids == [t])
    stop = tokenizer.decode([stop_id])
    new = tokenizer.encode("general kenobi", add_special_tokens=False).ids + [stop_id]
    request = read(sampling_param_stop=np.array([stop.encode()], object),
                   return_finish_reason=np.array([True]), return_stop_reason=np.array([True]))
    reply = LlmapiReply(tokenizer, end_id=2)
    reply.start(request, prompt, [[stop_id]])
    out = reply.respond(new, {"full_text": True}, final=True)
    assert out["text_output"][0].decode() == tokenizer.decode(prompt + new[:-1],
                                                             skip_special_tokens=True)
    assert (out["finish_reason"][0].decode(), out["stop_reason"][0].decode()) == ("stop", stop)
    assert "kv_cache_hit_rate" not in out and "cumulative_logprob" not in out


def test_kv_cache_use_counts_a_prompts_blocks_and_its_cached_ones_as_hits():
    """Blocks of the prefix cache's size: a partial last block is one; the cached tokens'
    whole blocks are the hits."""
    assert kv_cache_use(5, 0, 32) == {"kv_cache_alloc_new_blocks": 1,
                                      "kv_cache_reused_blocks": 0,
                                      "kv_cache_missed_blocks": 1,
                                      "kv_cache_alloc_total_blocks": 1,
                                      "kv_cache_hit_rate": 0.0}
    used = kv_cache_use(130, 96, 32)  # 5 blocks, the first 3 cached
    assert (used["kv_cache_reused_blocks"], used["kv_cache_alloc_new_blocks"],
            used["kv_cache_alloc_total_blocks"], used["kv_cache_hit_rate"]) == (3, 2, 5, 0.6)
