"""``dejavu up --trtllm-api llmapi``: TensorRT-LLM's LLM-API ``tensorrt_llm`` as its
model.yaml deploys it (not decoupled), against a real 1P+1T cluster, called as the stock
``llmapi_client.py`` calls it (:mod:`llmapi_calls`): its default unary call gets the greedy
reference text, the same every time; a stop request with the same request id and a client
cancel each end a running request and free its slot on the T-node; every input of the
published config is honoured (as the ensemble honours the same parameter) or refused,
named, with INVALID_ARGUMENT."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import (
    LONG,
    PROMPTS,
    cancel_rounds,
    module_cluster,
    reference,
    report_cancels,
    t_nodes_held,
)
from llmapi_calls import Stream, Unary, is_cancelled, request_inputs, stop_inputs, text, unary
from tritonclient.utils import InferenceServerException

from clients.generate import stream_grpc
from clients.perf import install_tools
from orchestrator.control.auth import load_secret
from orchestrator.control.client import ControlClient
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.llmapi import DEFAULT_MAX_TOKENS

pytestmark = pytest.mark.slow
MAX_TOKENS = 12

KV_BLOCK = 4  # small blocks: the tests' short prompts span several
# The P-node's prefix cache on, as `dejavu up` has it: every call below runs through it.
cluster = module_cluster("llmapi", prefill=1, decode=1, trtllm_api="llmapi",
                         prefix_cache_mb=4, kv_block=KV_BLOCK)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def expected(model):
    """Greedy reference ids, ending at the tokenizer's end token (SamplingParams' end_id)."""
    return reference(model, PROMPTS[:3], MAX_TOKENS)


def with_prompt(tokenizer, prompt: str, ids: list[int]) -> str:
    """A non-streaming answer's text: exclude_input_from_output is false unless sent."""
    return tokenizer.decode(tokenizer.encode(prompt).ids + ids, skip_special_tokens=True)


def test_the_clients_unary_call_gets_the_greedy_reference_text_every_time(
        cluster, model, tokenizer, expected):
    url = cluster.frontend.grpc_url
    with grpcclient.InferenceServerClient(url) as client:
        config = client.get_model_config("tensorrt_llm").config
    assert not config.model_transaction_policy.decoupled and config.max_batch_size == 0
    for prompt, ids in zip(PROMPTS[:3], expected, strict=True):
        want = with_prompt(tokenizer, prompt, ids)
        assert [text(unary(url, request_inputs(prompt, MAX_TOKENS), request_id=str(i)))
                for i in range(3)] == [want] * 3
    # sampling_param_max_tokens unset: SamplingParams' 32
    default = reference(model, PROMPTS[:1], DEFAULT_MAX_TOKENS)[0]
    assert text(unary(url, request_inputs(PROMPTS[0]))) == with_prompt(tokenizer, PROMPTS[0],
                                                                       default)


def until_generating(cluster, control: ControlClient, timeout_s: float = 30.0) -> None:
    """Until the T-node holds a client's request (it is generating)."""
    deadline = time.monotonic() + timeout_s
    while t_nodes_held(cluster, control)["clients"] != 1:
        assert time.monotonic() < deadline, t_nodes_held(cluster, control)
        time.sleep(0.02)


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_a_stop_request_with_the_same_request_id_ends_it_and_frees_its_slot(cluster, rpc):
    """``--stop-after-ms``: a second request, ``stop`` true, with the first one's request id
    (the client sends both unary, or both on one stream as its newest version does). The
    stop answers CANCELLED; so does the stopped request if it was still running; the
    T-node then holds nothing."""
    control = ControlClient(load_secret(cluster.secret_file), 30.0)
    answers = []

    def start():
        call = (Unary if rpc == "unary" else Stream)(
            cluster.frontend.grpc_url, request_inputs(PROMPTS[0], LONG), request_id="stop-me",
            streaming=False)
        until_generating(cluster, control)
        return call

    def leave(call) -> None:
        if rpc == "unary":
            answers.append((call.stop("stop-me"), call.result()))
        else:
            call.stop("stop-me")
            answers.append((call.next(), call.next()))
            call.close()

    try:
        report_cancels(f"stop request ({rpc})", cancel_rounds(cluster, start, leave, 2), 2)
    finally:
        control.close()
    for stop_answer, stopped in answers:
        assert is_cancelled(stop_answer)
        assert is_cancelled(stopped) or len(text(stopped)) > 0


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_a_client_cancel_frees_the_slot(cluster, rpc):
    """``--stop-via-request-cancel``: the unary call's future cancelled, or the stream
    closed with its requests cancelled."""
    control = ControlClient(load_secret(cluster.secret_file), 30.0)

    def start():
        call = (Unary if rpc == "unary" else Stream)(
            cluster.frontend.grpc_url, request_inputs(PROMPTS[1], LONG), request_id="cancel-me",
            streaming=False)
        until_generating(cluster, control)
        return call

    def leave(call) -> bool | None:
        if rpc == "unary":
            call.future.cancel()
            answer = call.result()  # cancelled, or whole if it ended before the cancel took
            assert is_cancelled(answer) or len(text(answer)) > 0
            return is_cancelled(answer)
        call.cancel()
        return None

    try:
        report_cancels(f"client cancel ({rpc})", cancel_rounds(cluster, start, leave, 2), 2)
    finally:
        control.close()


def test_a_stop_request_needs_a_request_id(cluster):
    got = unary(cluster.frontend.grpc_url, stop_inputs(), request_id="")
    assert isinstance(got, InferenceServerException)
    assert got.status() == "StatusCode.INVALID_ARGUMENT" and "request id" in got.message()


@pytest.mark.parametrize(("name", "array", "message"), [
    ("lora_id", np.array([1], np.uint64), "LoRA adapters"),
    ("lora_name", np.array(["adapter"], object), "LoRA adapters"),
    ("lora_path", np.array(["/adapters/a"], object), "LoRA adapters"),
    ("lora_ckpt_source", np.array(["hf"], object), "LoRA adapters"),
    ("image_url", np.array(["https://example.com/a.png"], object), "multimodal input"),
    ("sampling_param_best_of", np.array([2], np.int32), "only 1"),
    ("streaming", np.array([True]), "only supported in decoupled mode"),
    ("sampling_param_top_p", np.array([1.5], np.float32), "top_p must be in [0, 1]"),
])
def test_inputs_it_cannot_serve_are_refused_by_name_and_it_serves_on(
        cluster, tokenizer, expected, name, array, message):
    url = cluster.frontend.grpc_url
    got = unary(url, request_inputs(PROMPTS[0], MAX_TOKENS, **{name: array}))
    assert isinstance(got, InferenceServerException)
    assert got.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in got.message() and name in got.message()
    assert text(unary(url, request_inputs(PROMPTS[0], MAX_TOKENS))) == with_prompt(
        tokenizer, PROMPTS[0], expected[0])


def test_the_streaming_parameter_is_refused_when_not_decoupled(cluster):
    got = unary(cluster.frontend.grpc_url, request_inputs(PROMPTS[0], MAX_TOKENS),
                streaming=True)
    assert isinstance(got, InferenceServerException)
    assert got.status() == "StatusCode.INVALID_ARGUMENT" and "Streaming" in got.message()


def test_sampling_params_are_honoured_as_the_ensembles_same_parameters(cluster, tokenizer):
    """Sampling (top_k, top_p, temperature, seed), the penalties, exclude_input_from_output
    and cumulative_logprob give what tensorrt_llm_bls gives for the same parameters."""
    url = cluster.frontend.grpc_url
    sampled = {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "seed": 7,
               "presence_penalty": 0.5, "frequency_penalty": 0.3}
    dtypes = {"top_k": np.int32, "seed": np.uint64}
    inputs = {f"sampling_param_{k}": np.array([v], dtypes.get(k, np.float32))
              for k, v in sampled.items()}
    got = unary(url, request_inputs(
        PROMPTS[2], MAX_TOKENS, **inputs,
        sampling_param_exclude_input_from_output=np.array([True]),
        return_cumulative_logprob=np.array([True]), return_finish_reason=np.array([True])))
    chunks = list(stream_grpc(url, PROMPTS[2], False, "tensorrt_llm_bls", max_tokens=MAX_TOKENS,
                              exclude_input_in_output=True, return_log_probs=True, **sampled))
    ids = [t for c in chunks for t in c.ids]
    assert text(got) == tokenizer.decode(ids, skip_special_tokens=True)
    assert np.isclose(got.as_numpy("cumulative_logprob")[0], chunks[-1].cum_log_prob, atol=1e-4)
    assert got.as_numpy("finish_reason")[0].decode() in ("length", "stop")
    again = unary(url, request_inputs(PROMPTS[2], MAX_TOKENS, **inputs,
                                      sampling_param_exclude_input_from_output=np.array([True])))
    assert text(again) == text(got)  # seeded: the same sample


def test_a_stop_string_ends_the_text_before_it(cluster, model, tokenizer):
    """``sampling_param_stop``: the generation ends at the first stop string, which the text
    leaves out (SamplingParams' include_stop_str_in_output false); finish_reason "stop",
    stop_reason the string. Unstopped, finish_reason is "length" and stop_reason "None"."""
    ids = reference(model, PROMPTS[:1], MAX_TOKENS, to_end=False)[0]
    # a token that is its own text's only token, first met at position k >= 2
    k, word = next((k, tokenizer.decode([t])) for k, t in enumerate(ids)
                   if k >= 2 and t not in ids[:k]
                   and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False).ids == [t])
    url = cluster.frontend.grpc_url
    flags = {"return_finish_reason": np.array([True]), "return_stop_reason": np.array([True]),
             "sampling_param_exclude_input_from_output": np.array([True])}
    got = unary(url, request_inputs(PROMPTS[0], MAX_TOKENS, **flags,
                                    sampling_param_stop=np.array([word.encode()], object)))
    assert text(got) == tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert got.as_numpy("finish_reason")[0].decode() == "stop"
    assert got.as_numpy("stop_reason")[0].decode() == word
    plain = unary(url, request_inputs(PROMPTS[0], MAX_TOKENS, **flags))
    assert (plain.as_numpy("stop_reason")[0].decode(), plain.as_numpy("finish_reason")[0]
            .decode()) == ("None", "length" if len(ids) == MAX_TOKENS else "stop")


def test_perf_metrics_and_kv_cache_counts(cluster, tokenizer):
    """``sampling_param_return_perf_metrics``: the timestamps in order and the kv_cache_*
    counts (:func:`orchestrator.serving.outputs.kv_cache_use`) in the prefix cache's blocks:
    a new prompt's all missed; the same prompt again finds every block but its last token's
    in the P-node's cache (reused, a hit rate), as TensorRT-LLM's KV reuse reports it; not
    asked for, none of them."""
    url = cluster.frontend.grpc_url
    prompt = f"Asked twice for its KV-cache counts: {PROMPTS[0]}"  # no other test sends it
    tokens = len(tokenizer.encode(prompt).ids)
    blocks = -(-tokens // KV_BLOCK)

    def counts() -> dict:
        got = unary(url, request_inputs(prompt, MAX_TOKENS,
                                        sampling_param_return_perf_metrics=np.array([True])))
        return {name: got.as_numpy(name)[0].item() for name in (
            "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
            "last_token_time_ns", "kv_cache_reused_block", "kv_cache_missed_block",
            "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks", "kv_cache_hit_rate",
            "total_draft_tokens")}

    first, again = counts(), counts()
    assert (first["arrival_time_ns"] <= first["first_scheduled_time_ns"]
            <= first["first_token_time_ns"] <= first["last_token_time_ns"])
    assert (first["kv_cache_reused_block"], first["kv_cache_missed_block"],
            first["kv_cache_alloc_new_blocks"], first["kv_cache_alloc_total_blocks"],
            first["kv_cache_hit_rate"], first["total_draft_tokens"]) == (
                0, blocks, blocks, blocks, 0.0, 0)
    reused = (tokens - 1) // KV_BLOCK  # one token at least is computed: its logits
    assert reused >= 2
    assert (again["kv_cache_reused_block"], again["kv_cache_missed_block"],
            again["kv_cache_alloc_total_blocks"]) == (reused, blocks - reused, blocks)
    assert again["kv_cache_hit_rate"] == pytest.approx(reused / blocks)
    plain = unary(url, request_inputs(PROMPTS[0], MAX_TOKENS))
    assert plain.as_numpy("arrival_time_ns") is None and plain.as_numpy("finish_reason") is None


# aiperf's template endpoint: the model's inputs as Triton's HTTP infer takes them
AIPERF_TEMPLATE = (
    '{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", '
    '"data": [{{ text|tojson }}]}, {"name": "sampling_param_max_tokens", "shape": [1], '
    '"datatype": "INT32", "data": [{{ max_tokens }}]}]}')
AIPERF_TEXT = "response_field:outputs[?name=='text_output'].data[0] | [0]"


def test_aiperf_loads_it_through_its_template_endpoint(cluster, model, tmp_path):
    """genai-perf 0.0.16 cannot (its Triton inputs are the ensemble's: max_tokens, ...);
    aiperf, its successor, with a payload template over Triton's HTTP infer: every request
    completes."""
    tools = install_tools()
    (tmp_path / "llmapi.json.j2").write_text(AIPERF_TEMPLATE)
    subprocess.run([str(tools.aiperf), "profile", "-m", "tensorrt_llm",
                    "--endpoint-type", "template", "-u", f"http://{cluster.frontend.http_url}",
                    "--endpoint", "/v2/models/tensorrt_llm/infer",
                    "--extra-inputs", "payload_template:llmapi.json.j2",
                    "--extra-inputs", AIPERF_TEXT, "--tokenizer", str(model),
                    "--concurrency", "2", "--request-count", "4", "--warmup-request-count", "2",
                    "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
                    "--output-tokens-mean", str(MAX_TOKENS), "--random-seed", "0",
                    "--ui-type", "none", "--artifact-dir", "artifacts"],
                   cwd=tmp_path, env=tools.env(), check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    summary = json.loads((tmp_path / "artifacts" / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 4
    assert not summary.get("error_summary")
