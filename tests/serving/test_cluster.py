"""Disaggregated serving on real tritonservers: a frontend, one P-node and one T-node.

Tokens come out exactly as the single-process reference makes them, through
gRPC streaming, HTTP ``generate_stream`` and HTTP ``generate``, for requests
that run at the same time; bad requests get an error that says what is wrong
and the cluster serves the next one.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import (
    LONG,
    MAX_SEQ_LEN,
    PROMPTS,
    assert_log_probs_match_reference,
    cancel_rounds,
    eventually,
    first_tokens,
    ids_of,
    metric,
    module_cluster,
    module_reference,
    report_cancels,
    run_concurrently,
    stream_orchestrator,
    t_nodes_held,
    text_of,
)
from tritonclient.utils import InferenceServerException

from clients.generate import GenerateError, generate_batch, stream_grpc, stream_http
from orchestrator.control.auth import load_secret, request_parameters
from orchestrator.control.client import ControlClient, tensor
from orchestrator.control.errors import ErrorCode
from orchestrator.engine.reference import generate, log_softmax_along
from orchestrator.engine.sampling import SamplingParams
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.engine.torch_engine import load_engine
from orchestrator.fault.rpc import Stub
from orchestrator.serving.params import GenerationParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


cluster = module_cluster("disaggregated", prefill=1, decode=1)
expected = module_reference(PROMPTS, MAX_TOKENS)


def secret(cluster) -> bytes:
    return load_secret(cluster.secret_file)


def good_request_works(cluster, expected) -> None:
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected[0]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrent_streams_match_reference(cluster, model, expected, protocol):
    url = cluster.frontend.grpc_url if protocol == "grpc" else cluster.frontend.http_url
    results = run_concurrently(protocol, url, PROMPTS, max_tokens=MAX_TOKENS)
    assert [ids_of(chunks) for chunks in results] == expected
    # Tokens stream as they are made: a response per token, or several in one for a stream
    # that fell behind; none comes empty.
    assert all(chunk.ids for chunks in results for chunk in chunks)
    tokenizer = load_tokenizer(model)
    assert [text_of(c) for c in results] == [tokenizer.decode(ids) for ids in expected]


def test_http_generate_without_streaming(cluster, model, expected):
    results = run_concurrently(
        "http", cluster.frontend.http_url, PROMPTS, max_tokens=MAX_TOKENS, stream=False
    )
    assert all(len(chunks) == 1 for chunks in results)
    assert [ids_of(chunks) for chunks in results] == expected


def test_end_id_stops_early(cluster, expected):
    end_id = expected[1][3]
    chunks = list(
        stream_grpc(cluster.frontend.grpc_url, PROMPTS[1], max_tokens=MAX_TOKENS, end_id=end_id)
    )
    assert ids_of(chunks) == expected[1][: expected[1].index(end_id) + 1]


def test_sampling_parameters_are_used_and_seeded(cluster, expected):
    def sample(seed: int) -> list[int]:
        params = dict(max_tokens=MAX_TOKENS, temperature=1.5, top_k=50, random_seed=seed)
        return ids_of(stream_grpc(cluster.frontend.grpc_url, PROMPTS[2], **params))

    first, again, other = sample(1), sample(1), sample(2)
    assert first == again  # the same seed repeats on P and T
    assert len(first) == MAX_TOKENS and (first != other or first != expected[2])


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", {"max_tokens": 4}, "empty prompt"),
        ("token " * 300, {"max_tokens": 4}, "does not fit the context of 256"),
        ("hello", {"max_tokens": 0}, "max_tokens must be at least 1"),
        ("hello", {"max_tokens": -3}, "max_tokens must be at least 1"),
        ("hello", {"max_tokens": 300}, "exceeds the context of 256"),
        ("hello", {"max_tokens": 4, "top_p": 2.0}, "top_p must be in"),
        ("hello", {"max_tokens": 4, "temperature": float("nan")}, "temperature must be a fin"),
        ("hello", {"max_tokens": 4, "beam_width": 2}, "beam_width 2 is not supported"),
        ("hello", {"max_tokens": 4, "end_id": 10**6}, "end_id 1000000 outside the vocab"),
    ],
)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_requests_are_named_and_the_cluster_goes_on(
    cluster, expected, protocol, prompt, params, message
):
    url = cluster.frontend.grpc_url if protocol == "grpc" else cluster.frontend.http_url
    run = stream_grpc if protocol == "grpc" else stream_http
    with pytest.raises(GenerateError, match=message):
        list(run(url, prompt, **params))
    good_request_works(cluster, expected)


def _stream(url: str, model: str, inputs: dict[str, tuple[np.ndarray, str]]) -> list[tuple]:
    """One request on a gRPC stream: every (result, error) it got."""
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, (array, dtype) in inputs.items():
        tensors.append(grpcclient.InferInput(name, list(array.shape), dtype))
        tensors[-1].set_data_from_numpy(array)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer(model, tensors)
    finally:
        client.stop_stream()  # waits for the server to close the stream
    return results


def _infer(url: str, model: str, inputs: dict[str, tuple[np.ndarray, str]]):
    return [error for _, error in _stream(url, model, inputs) if error is not None]


@pytest.mark.parametrize(
    ("model_name", "max_tokens", "message"),
    [
        ("ensemble", (np.array([[4.0]], np.float32), "FP32"),
         "but model 'ensemble' expects 'int32'"),
        ("ensemble", (np.array([[4, 4]], np.int32), "INT32"), "shape"),
        ("no_such_model", (np.array([[4]], np.int32), "INT32"), "unknown model"),
    ],
)
def test_wrong_dtype_shape_or_model(cluster, expected, model_name, max_tokens, message):
    prompt = (np.array([[b"hello"]], dtype=np.object_), "BYTES")
    errors = _infer(
        cluster.frontend.grpc_url, model_name, {"text_input": prompt, "max_tokens": max_tokens}
    )
    assert errors and message in errors[0].message().lower(), errors
    good_request_works(cluster, expected)


def test_client_that_leaves_mid_stream_cancels_downstream(cluster, model, expected):
    """The frontend's orchestrator model cancelled by its client (stop_stream with
    cancel_requests=True) ends the request on the T-node, which drops it and frees its KV
    slot before making every token (rounds whose T-node had made them all already, a fast
    one, have nothing left to cancel: cancel_rounds counts the others)."""
    prompt_ids = load_tokenizer(model).encode(PROMPTS[0]).ids
    long = MAX_SEQ_LEN - len(prompt_ids)

    def start():
        stream = stream_orchestrator(cluster.frontend.grpc_url, prompt_ids, long,
                                     secret(cluster))
        assert first_tokens(stream, 3) == expected[0][:3]
        return stream

    seconds = cancel_rounds(cluster, start, lambda stream: stream.close(), rounds=5)
    report_cancels("gRPC cancel on orchestrator", seconds, 5)
    deadline = time.monotonic() + 10  # the frontend counts it once its call has ended
    while metric(cluster.frontend, "dejavu_requests", outcome="cancelled") < 1:
        assert time.monotonic() < deadline, "the frontend never counted the cancellation"
        time.sleep(0.05)
    good_request_works(cluster, expected)
    eventually(lambda: metric(cluster.role("decode")[0].server, "dejavu_queue_length"),
               lambda n: n == 0)


def test_client_that_leaves_an_ensemble_stream_does_not_hurt_the_cluster(cluster, expected):
    # Triton's ensemble scheduler passes a cancellation on only between steps, so a
    # running decoupled step (the orchestrator) finishes its request: bounded by max_tokens.
    stream = stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_SEQ_LEN - 8)
    assert len(first_tokens(stream, 3)) == 3
    stream.close()
    for _ in range(3):
        good_request_works(cluster, expected)


def test_kv_bytes_streamed_agree_on_both_sides(cluster, model, expected):
    prefill, decode = cluster.role("prefill")[0].server, cluster.role("decode")[0].server
    sent, received = metric(prefill, "dejavu_kv_bytes"), metric(decode, "dejavu_kv_bytes")
    good_request_works(cluster, expected)
    prompt_len = len(load_tokenizer(model).encode(PROMPTS[0]).ids)
    layout = load_engine(model, max_seq_len=MAX_SEQ_LEN).kv_layout
    nbytes = prompt_len * layout.token_bytes_per_layer() * layout.num_layers
    assert eventually(lambda: metric(prefill, "dejavu_kv_bytes") - sent, bool) == nbytes
    assert eventually(lambda: metric(decode, "dejavu_kv_bytes") - received, bool) == nbytes
    assert metric(decode, "dejavu_kv_transfer_seconds") > 0


def test_the_frontend_times_each_admission_and_p_node_call(cluster, expected):
    """The legs the simulator's dispatch is measured from (docs/bench-kv-reuse.md): a
    request adds a T-node admission and a P-node call on the frontend, and the calls' wait
    holds at least the P-node's own queue and execute time (Triton's counters)."""
    frontend, prefill = cluster.frontend, cluster.role("prefill")[0].server

    def legs() -> tuple[float, float, float, float]:
        return (metric(frontend, "dejavu_legs", what="admission"),
                metric(frontend, "dejavu_legs", what="prefill_call"),
                metric(frontend, "dejavu_leg_seconds", what="prefill_call"),
                sum(metric(prefill, name, model="prefill") for name in (
                    "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us")))

    before = legs()
    good_request_works(cluster, expected)
    after = eventually(legs, lambda now: now[1] > before[1])
    admissions, calls, waited, served_us = (a - b for a, b in zip(after, before, strict=True))
    assert admissions >= 1 and calls >= 1
    assert waited >= served_us / 1e6 > 0


def test_http_infer_on_the_decoupled_ensemble_says_so(cluster):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(cluster.frontend.http_url)
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="decoupled"):
        client.infer("ensemble", [text])


def test_a_hundred_failed_or_cancelled_requests_leave_nothing_behind(cluster, model, expected):
    """50 rejected + 50 cancelled mid-stream, then more concurrent requests than KV slots.

    The T-node has 16 prompt-KV slots: had each cancelled request leaked one, the
    17th cancelled stream and the final burst of 18 would fail; a leaked microbatch
    seat keeps the queue non-empty; a leaked Python-backend region shows in /dev/shm.
    """
    servers = [node.server for node in cluster.nodes]
    regions_before = {s.name: len(s.shm_regions()) for s in servers}
    long_prompt = "word " * MAX_SEQ_LEN
    bad = [("", MAX_TOKENS), (PROMPTS[0], 0), (PROMPTS[0], -1), (PROMPTS[0], MAX_SEQ_LEN + 1),
           (long_prompt, MAX_TOKENS)]
    for i in range(50):
        prompt, max_tokens = bad[i % len(bad)]
        with pytest.raises(GenerateError):
            list(stream_grpc(cluster.frontend.grpc_url, prompt, max_tokens=max_tokens))
    prompt_ids = load_tokenizer(model).encode(PROMPTS[1]).ids
    for _ in range(50):
        stream = stream_orchestrator(cluster.frontend.grpc_url, prompt_ids, MAX_SEQ_LEN - 16,
                                     secret(cluster))
        assert first_tokens(stream, 1) == [expected[1][0]]
        stream.close()

    decode = cluster.role("decode")[0].server
    deadline = time.monotonic() + 30
    while metric(decode, "dejavu_queue_length") > 0:
        assert time.monotonic() < deadline, "the T-node still holds cancelled requests"
        time.sleep(0.1)
    regions_after = {s.name: len(s.shm_regions()) for s in servers}
    assert regions_after == regions_before
    burst = PROMPTS * 3  # 18 requests at once > 16 KV slots
    results = run_concurrently("grpc", cluster.frontend.grpc_url, burst, max_tokens=MAX_TOKENS)
    assert [ids_of(r) for r in results] == expected * 3


def test_no_model_config_on_any_node_reveals_the_secret(cluster):
    """Every node's model configs (its repository's files; the frontend's also as its open
    config API serves them: no client may read an internal node's) name the secret's file,
    never the secret."""
    import os
    import stat
    import urllib.request

    hexed = secret(cluster).hex()
    assert stat.S_IMODE(os.stat(cluster.secret_file).st_mode) == 0o600
    for node in cluster.nodes:
        server = node.server
        models = sorted(p.parent.name for p in server.repo.glob("*/config.pbtxt"))
        assert models
        configs = [(server.repo / name / "config.pbtxt").read_text() for name in models]
        if node.role == "frontend":
            assert set(models) == {"ensemble", "preprocessing", "orchestrator",
                                   "tensorrt_llm_bls", "tensorrt_llm", "postprocessing"}
            client = grpcclient.InferenceServerClient(server.grpc_url)
            for name in models:
                url = f"http://{server.http_url}/v2/models/{name}/config"
                with urllib.request.urlopen(url, timeout=10) as response:
                    configs.append(response.read().decode())
                configs.append(json.dumps(client.get_model_config(name, as_json=True)))
            client.close()
        for config in configs:
            assert hexed not in config and '"secret"' not in config, node.role


def _first_response(url: str, model: str, tensors: list, parameters: dict | None = None):
    """One streamed request's first answer: (result, error)."""
    import queue

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, tensors, request_id="intruder",
                                  parameters=parameters or {})
        return answers.get(timeout=30)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _code(result) -> ErrorCode:
    return ErrorCode(int(result.as_numpy("error_code")[0]))


def test_internal_surfaces_refuse_requests_without_the_secret(cluster, model, expected):
    prompt_ids = load_tokenizer(model).encode(PROMPTS[0]).ids
    ids = np.array(prompt_ids, dtype=np.int32)
    decode = cluster.role("decode")[0].server.grpc_url
    arrays = {"op": np.array([b"reserve"], dtype=np.object_), "input_ids": ids}
    forged = request_parameters(b"guessed-but-wrong-secret", "decode", "reserve", "intruder",
                                decode, arrays)
    # 20 reserves (more than the T-node's 16 prompt-KV slots), unsigned or badly signed:
    # every one refused, none holds a slot.
    for parameters in [None, forged] * 10:
        reserve = [tensor(k, v) for k, v in arrays.items()]
        result, error = _first_response(decode, "decode", reserve, parameters)
        assert error is None and _code(result) is ErrorCode.UNAUTHENTICATED
        assert "cluster secret" in result.as_numpy("error")[0].decode()
    params = [tensor("input_ids", ids),
              tensor("params", np.array([GenerationParams(4).to_json()], dtype=np.object_))]
    result, _ = _first_response(decode, "decode", params)  # a generate request
    assert _code(result) is ErrorCode.UNAUTHENTICATED
    ticket = tensor("kv_ticket", np.array([b"x"], dtype=np.object_))
    prefill = grpcclient.InferenceServerClient(cluster.role("prefill")[0].server.grpc_url)
    answer = prefill.infer("prefill", [*params, ticket])
    assert ErrorCode(int(answer.as_numpy("error_code")[0])) is ErrorCode.UNAUTHENTICATED
    prefill.close()
    # The frontend's orchestrator model serves the ensemble only.
    batched = [tensor("input_ids", ids[None]), tensor("max_tokens", np.array([[4]], np.int32)),
               tensor("input_lengths", np.array([[len(ids)]], np.int32))]
    for auth in [[], [tensor("input_auth", np.array([[b"1:00:00"]], dtype=np.object_))]]:
        _, error = _first_response(cluster.frontend.grpc_url, "orchestrator", [*batched, *auth])
        assert error is not None and "cluster secret" in error.message()
    stub = Stub(cluster.controller.address, b"guessed-but-wrong-secret")
    fake = {"node_id": "fake", "pipeline": "prefill0", "stage": 0, "depth": 1, "role": "prompt",
            "address": cluster.role("prefill")[0].server.grpc_url}
    with pytest.raises(Exception, match="bad request signature"):
        stub.call("Register", fake, 5.0)
    stub.close()
    results = run_concurrently("grpc", cluster.frontend.grpc_url, PROMPTS * 3,
                               max_tokens=MAX_TOKENS)  # 18 at once: every slot is free
    assert [ids_of(r) for r in results] == expected * 3
# -- the TensorRT-LLM ensemble contract ----------------------------------------------------


ENTRY_POINTS = ["ensemble", "tensorrt_llm_bls"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("stream", [True, False])
def test_a_batch_of_four_prompts_in_one_call(cluster, model, expected, stream, entry):
    """[4, 1] tensors: each row its own sequence, told apart by batch_index; without
    streaming text_output holds the prompt and then the generation, as in the backend."""
    chunks = generate_batch(cluster.frontend.grpc_url, PROMPTS[:4], stream=stream,
                            max_tokens=MAX_TOKENS, model=entry)
    assert sorted(chunks) == [(row, 0) for row in range(4)]
    assert [ids_of(chunks[(row, 0)]) for row in range(4)] == expected[:4]
    tokenizer = load_tokenizer(model)
    for row in range(4):
        generation = tokenizer.decode(expected[row])
        text = text_of(chunks[(row, 0)])
        if stream:
            assert text == generation
        else:
            prompt_ids = tokenizer.encode(PROMPTS[row]).ids
            assert text == tokenizer.decode(prompt_ids + expected[row])
            assert text.startswith(PROMPTS[row]) and len(chunks[(row, 0)]) == 1
    excluded = generate_batch(cluster.frontend.grpc_url, PROMPTS[:1], stream=False,
                              max_tokens=MAX_TOKENS, exclude_input_in_output=True, model=entry)
    assert text_of(excluded[(0, 0)]) == tokenizer.decode(expected[0])


def _roundtrip_token(tokenizer, ids: list[int]) -> tuple[int, str]:
    """A generated token whose text, tokenized alone, is that token again."""
    for i, token in enumerate(ids[1:], 1):
        word = tokenizer.decode([token])
        if word.strip() and tokenizer.encode(word, add_special_tokens=False).ids == [token]:
            return i, word
    raise AssertionError("no token of the reference round-trips alone")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_stop_words_cut_after_the_word_and_bad_words_never_appear(cluster, model, expected,
                                                                  entry):
    tokenizer = load_tokenizer(model)
    at, word = _roundtrip_token(tokenizer, expected[0])
    url = cluster.frontend.grpc_url
    stopped = list(stream_grpc(url, PROMPTS[0], max_tokens=MAX_TOKENS, stop_words=[word],
                               model=entry))
    assert ids_of(stopped) == expected[0][: expected[0].index(expected[0][at]) + 1]
    assert text_of(stopped).endswith(word)
    banned = ids_of(stream_grpc(url, PROMPTS[0], max_tokens=MAX_TOKENS, bad_words=[word],
                                model=entry))
    assert expected[0][at] not in banned and len(banned) == MAX_TOKENS
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    prompt = tokenizer.encode(PROMPTS[0]).ids
    ban = SamplingParams(bad_words=((expected[0][at],),))
    assert banned == generate([engine], [prompt], MAX_TOKENS, sampling=ban)[0]


def test_min_tokens_holds_off_end_id(cluster, expected):
    end_id = expected[1][1]
    url = cluster.frontend.grpc_url
    early = ids_of(stream_grpc(url, PROMPTS[1], max_tokens=MAX_TOKENS, end_id=end_id))
    assert early == expected[1][:2]
    held = ids_of(stream_grpc(url, PROMPTS[1], max_tokens=MAX_TOKENS, end_id=end_id,
                              min_tokens=6))
    assert len(held) >= 6 and end_id not in held[:5]


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.5}, {"presence_penalty": 1.0, "frequency_penalty": 0.5}])
def test_penalties_match_the_reference(cluster, model, penalty):
    """Penalised greedy tokens equal the single-process reference with the same penalty
    (P-node's first token and T-node's rest), and differ from plain greedy."""
    tokenizer = load_tokenizer(model)
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    prompt = tokenizer.encode(PROMPTS[3]).ids
    want = generate([engine], [prompt], 24, sampling=SamplingParams(**penalty))[0]
    assert want != generate([engine], [prompt], 24)[0]
    got = ids_of(stream_grpc(cluster.frontend.grpc_url, PROMPTS[3], max_tokens=24, **penalty))
    assert got == want


def test_n_samples_differ_and_repeat_with_a_seed(cluster):
    params = dict(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, seed=5,
                  num_return_sequences=2)
    first = generate_batch(cluster.frontend.grpc_url, PROMPTS[2:3], **params)
    again = generate_batch(cluster.frontend.grpc_url, PROMPTS[2:3], **params)
    assert sorted(first) == [(0, 0), (0, 1)]
    samples = [ids_of(first[(0, i)]) for i in range(2)]
    assert samples == [ids_of(again[(0, i)]) for i in range(2)]
    assert samples[0] != samples[1]


def test_perf_metrics_and_refused_inputs(cluster, expected):
    prompt = (np.array([[b"hello"]], dtype=np.object_), "BYTES")
    one = (np.array([[4]], np.int32), "INT32")
    inputs = {"text_input": prompt, "max_tokens": one,
              "return_perf_metrics": (np.array([[True]]), "BOOL")}
    (result, error), = _stream(cluster.frontend.grpc_url, "ensemble", inputs)
    assert error is None, error
    times = [int(result.as_numpy(f"{name}_time_ns").reshape(-1)[0]) for name in
             ("arrival", "first_scheduled", "first_token", "last_token")]
    assert times == sorted(times) and times[0] > 0
    assert int(result.as_numpy("kv_cache_alloc_total_blocks").reshape(-1)[0]) == 1
    for name, (array, dtype), message in [
        ("lora_task_id", (np.array([[3]], np.uint64), "UINT64"), "LoRA adapters"),
        ("guided_decoding_guide_type", (np.array([[b"json"]], np.object_), "BYTES"),
         "guided decoding"),
        ("return_generation_logits", (np.array([[True]]), "BOOL"), "no logits"),
    ]:
        errors = _infer(cluster.frontend.grpc_url, "ensemble",
                        {"text_input": prompt, "max_tokens": one, name: (array, dtype)})
        assert errors and name in errors[0].message() and message in errors[0].message()
    good_request_works(cluster, expected)


def test_log_probs_equal_the_reference_log_softmax(cluster, model):
    """The P-node's first token's and the T-node's rest."""
    assert_log_probs_match_reference(cluster.frontend.grpc_url, model, PROMPTS[4], MAX_TOKENS)


def test_tensorrt_llm_bls_serves_the_same_contract(cluster, expected):
    """Batches of prompts are in test_a_batch_of_four_prompts_in_one_call; here HTTP, n,
    log-probs and the refusals, as the ensemble gives them."""
    url = cluster.frontend.grpc_url
    asked = dict(max_tokens=4, return_log_probs=True, top_log_probs=2)
    bls = generate_batch(url, PROMPTS[:1], model="tensorrt_llm_bls", **asked)[(0, 0)]
    ensemble = generate_batch(url, PROMPTS[:1], **asked)[(0, 0)]
    # The same tokens' log-probs (how they were cut into responses may differ: a stream
    # that fell behind gets several in one).
    assert [(p, t) for c in bls for p, t in zip(c.log_probs, c.top, strict=True)] == [
        (p, t) for c in ensemble for p, t in zip(c.log_probs, c.top, strict=True)]
    assert bls[-1].cum_log_prob == ensemble[-1].cum_log_prob
    assert len([p for c in bls for p in c.log_probs]) == 4
    http = list(stream_http(cluster.frontend.http_url, PROMPTS[2], model="tensorrt_llm_bls",
                            max_tokens=MAX_TOKENS))
    assert ids_of(http) == expected[2]
    whole = list(stream_http(cluster.frontend.http_url, PROMPTS[2], model="tensorrt_llm_bls",
                             max_tokens=MAX_TOKENS, stream=False))
    assert len(whole) == 1 and ids_of(whole) == expected[2]
    sampled = dict(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, seed=5,
                   num_return_sequences=2)
    assert ({k: ids_of(c) for k, c in generate_batch(url, PROMPTS[2:3], **sampled).items()}
            == {k: ids_of(c) for k, c in generate_batch(url, PROMPTS[2:3], model=
                                                         "tensorrt_llm_bls", **sampled).items()})
    for prompt, params, message in [
        (PROMPTS[0], {"max_tokens": 4, "beam_width": 3}, "beam_width 3 is not supported"),
        ("", {"max_tokens": 4}, "empty prompt"),
        ("token " * 300, {"max_tokens": 4}, "does not fit the context of 256"),
        ("hello", {"max_tokens": 300}, "exceeds the context of 256"),
        ("hello", {"max_tokens": 4, "end_id": 10**6}, "end_id 1000000 outside the vocab"),
    ]:
        with pytest.raises(GenerateError, match=message):
            list(stream_grpc(url, prompt, model="tensorrt_llm_bls", **params))
    good_request_works(cluster, expected)


# -- cancellation through the entry points clients call ------------------------------------


def test_a_cancelled_tensorrt_llm_bls_stream_leaves_the_t_node(cluster, expected):
    """gRPC ``stop_stream(cancel_requests=True)`` on tensorrt_llm_bls: the T-node drops
    the request and frees its slot (the ensemble's runs to max_tokens, below)."""
    def start():
        stream = stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], model="tensorrt_llm_bls",
                             max_tokens=LONG)
        assert first_tokens(stream, 2) == expected[0][:2]
        return stream

    seconds = cancel_rounds(cluster, start, lambda stream: stream.close(), rounds=10)
    report_cancels("gRPC cancel on tensorrt_llm_bls", seconds, 10)
    assert len(seconds) >= 3, f"only {len(seconds)} of 10 streams were still generating"
    good_request_works(cluster, expected)


def test_an_http_generate_stream_client_that_leaves_frees_the_t_node(cluster, expected):
    """Triton 2.51's HTTP frontend cancels a streaming (generate_stream) request whose
    client closed the connection; tensorrt_llm_bls then cancels it on the T-node."""
    import http.client

    def start():
        host, port = cluster.frontend.http_url.split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"text_input": PROMPTS[0], "max_tokens": LONG, "stream": True})
        connection.request("POST", "/v2/models/tensorrt_llm_bls/generate_stream", body)
        response = connection.getresponse()
        assert response.status == 200
        for _ in range(2):  # the first two tokens' events
            while not response.readline().startswith(b"data:"):
                pass
        return connection

    def leave(connection) -> None:
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()

    seconds = cancel_rounds(cluster, start, leave, rounds=5)
    report_cancels("HTTP generate_stream disconnect on tensorrt_llm_bls", seconds, 5)
    good_request_works(cluster, expected)


# -- the OpenAI-compatible API, through the openai SDK ------------------------------------


@pytest.fixture(scope="module")
def openai_client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.openai.url, api_key="unused", max_retries=0)


def _with_eos(model, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The reference's greedy tokens, ending at the model's eos as the API asks."""
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    tokenizer = load_tokenizer(model)
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    return generate([engine], [tokenizer.encode(p).ids for p in prompts], max_tokens, eos)


def test_openai_completions_stream_and_not(cluster, model, openai_client):
    tokenizer = load_tokenizer(model)
    (want,) = _with_eos(model, PROMPTS[:1], MAX_TOKENS)
    name = openai_client.models.list().data[0].id
    assert name == model.name
    done = openai_client.completions.create(model=name, prompt=PROMPTS[0],
                                            max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == tokenizer.decode(want)
    assert done.choices[0].finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
    assert done.usage.completion_tokens == len(want)
    assert done.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]).ids)
    chunks = list(openai_client.completions.create(
        model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices


def test_openai_stops_at_the_models_eos_unless_ignore_eos(cluster, model, openai_client):
    """OpenAI's semantics: a choice ends at the model's eos (finish_reason ``stop``, before
    ``max_tokens``); vLLM's ``ignore_eos`` runs on to ``max_tokens`` (``length``)."""
    tokenizer, max_tokens = load_tokenizer(model), 64
    ended = _with_eos(model, PROMPTS, max_tokens)
    i = next(i for i, ids in enumerate(ended) if len(ids) < max_tokens)  # eos comes early
    (full,) = generate([load_engine(model, max_seq_len=MAX_SEQ_LEN)],
                       [tokenizer.encode(PROMPTS[i]).ids], max_tokens)
    done = openai_client.completions.create(model=model.name, prompt=PROMPTS[i],
                                            max_tokens=max_tokens, temperature=0)
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == len(ended[i]) < max_tokens
    assert done.choices[0].text == tokenizer.decode(ended[i])
    ignored = openai_client.completions.create(model=model.name, prompt=PROMPTS[i],
                                               max_tokens=max_tokens, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == max_tokens
    assert ignored.choices[0].text == tokenizer.decode(full)


def test_openai_chat_stream_and_not(cluster, model, openai_client):
    tokenizer = load_tokenizer(model)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    (want,) = _with_eos(model, [f"user: {PROMPTS[1]}\nassistant:"], MAX_TOKENS)
    done = openai_client.chat.completions.create(model=model.name, messages=messages,
                                                 max_completion_tokens=MAX_TOKENS,
                                                 temperature=0)
    assert done.choices[0].message.content == tokenizer.decode(want)
    assert done.choices[0].message.role == "assistant"
    chunks = list(openai_client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(want)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_openai_n_samples_with_a_seed_and_stop(cluster, model, openai_client):
    def sample():
        done = openai_client.completions.create(model=model.name, prompt=PROMPTS[2], n=2,
                                                seed=9, temperature=1.0, max_tokens=MAX_TOKENS)
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    first = sample()
    assert first == sample() and first[0] != first[1]
    text = openai_client.completions.create(model=model.name, prompt=PROMPTS[0],
                                            max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = text[len(text) // 2:][:3]
    cut = openai_client.completions.create(model=model.name, prompt=PROMPTS[0], stop=[stop],
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_openai_log_probs_equal_the_reference_log_softmax(cluster, model, openai_client):
    """Completions ``logprobs: k`` and chat ``logprobs`` + ``top_logprobs``, streaming and
    not: each token's log-prob and alternatives are the reference model's log-softmax."""
    import openai

    tokenizer = load_tokenizer(model)
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    prompt = f"user: {PROMPTS[2]}\nassistant:"
    (want_ids,) = _with_eos(model, [prompt], MAX_TOKENS)
    rows = log_softmax_along([engine], tokenizer.encode(prompt).ids, want_ids)
    want = rows[range(len(want_ids)), want_ids].tolist()
    best = rows.topk(2, dim=-1)
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in want_ids]
    top = [{tokenizer.decode([i], skip_special_tokens=False): p for i, p in
            zip(ids, values, strict=True)} for ids, values in
           zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    common = dict(model=model.name, max_tokens=MAX_TOKENS, temperature=0)

    for stream in (False, True):
        made = openai_client.completions.create(prompt=prompt, logprobs=2, stream=stream,
                                                **common)
        if stream:
            parts = [c.choices[0].logprobs for c in made if c.choices[0].logprobs]
        else:
            parts = [made.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        assert tokens == pieces
        assert np.allclose([v for p in parts for v in p.token_logprobs], want, atol=1e-4)
        offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
        assert [p for part in parts for p in part.text_offset] == offsets
        alternatives = [d for p in parts for d in p.top_logprobs]
        for got, best_two, piece, value in zip(alternatives, top, pieces, want, strict=True):
            assert got.keys() == best_two.keys() | {piece}
            assert np.allclose([got[k] for k in best_two], list(best_two.values()), atol=1e-4)
            assert abs(got[piece] - value) < 1e-4

        chat = openai_client.chat.completions.create(
            messages=[{"role": "user", "content": PROMPTS[2]}], logprobs=True, top_logprobs=2,
            stream=stream, **common)
        if stream:
            content = [e for c in chat if c.choices and c.choices[0].logprobs
                       for e in c.choices[0].logprobs.content]
        else:
            content = chat.choices[0].logprobs.content
        assert [e.token for e in content] == pieces
        assert [bytes(e.bytes).decode() for e in content] == pieces
        assert np.allclose([e.logprob for e in content], want, atol=1e-4)
        for entry, best_two in zip(content, top, strict=True):
            assert {a.token: a.logprob for a in entry.top_logprobs}.keys() == best_two.keys()
            assert np.allclose([a.logprob for a in entry.top_logprobs],
                               list(best_two.values()), atol=1e-4)

    plain = openai_client.completions.create(prompt=prompt, **common)
    assert plain.choices[0].logprobs is None  # none unless asked
    for bad, message in (({"logprobs": 6}, "logprobs 6 is not supported: at most 5"),):
        with pytest.raises(openai.BadRequestError, match=message):
            openai_client.completions.create(prompt=prompt, **common, **bad)
    with pytest.raises(openai.BadRequestError, match="top_logprobs 6 is not supported"):
        openai_client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=6,
            **common)


def test_openai_errors_have_openai_shape(cluster, model, openai_client, expected):
    import openai

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai_client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"logprobs": 9}, {"max_tokens": 0},
                {"max_tokens": 10**6}):
        with pytest.raises(openai.BadRequestError):
            openai_client.completions.create(model=model.name, prompt="hi",
                                             **{"max_tokens": 4, **bad})
    good_request_works(cluster, expected)


def test_openai_clients_that_leave_free_the_t_node(cluster, model, openai_client, expected):
    """A streaming SDK client that closes its response mid-stream, and a non-streaming one
    that gives up (its timeout): the API cancels its gRPC stream to tensorrt_llm_bls, which
    cancels the request on the T-node."""
    import openai

    def start_stream():
        stream = openai_client.completions.create(model=model.name, prompt=PROMPTS[0],
                                                  max_tokens=LONG, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        return stream

    seconds = cancel_rounds(cluster, start_stream, lambda stream: stream.close(), rounds=5)
    report_cancels("OpenAI SDK stream closed", seconds, 5)

    # The client gives up a third of the way through: how long the request takes here.
    started = time.perf_counter()
    openai_client.completions.create(model=model.name, prompt=PROMPTS[0], max_tokens=LONG,
                                     temperature=0)
    impatient = openai_client.with_options(timeout=(time.perf_counter() - started) / 3)

    control = ControlClient(load_secret(cluster.secret_file), 30.0)

    def start_impatient() -> concurrent.futures.Future:
        # In a thread, so the round can see the T-node generating before the client gives
        # up. On a loaded host the client may give up first (its prompt still queued): that
        # round has nothing on the T-node to cancel, and cancel_rounds leaves it out.
        future = pool.submit(impatient.completions.create, model=model.name,
                             prompt=PROMPTS[0], max_tokens=LONG, temperature=0)
        deadline = time.monotonic() + 30.0
        while not future.done() and t_nodes_held(cluster, control)["clients"] != 1:
            assert time.monotonic() < deadline, "the request reached no T-node"
            time.sleep(0.02)
        return future

    def give_up(future: concurrent.futures.Future) -> None:
        with pytest.raises(openai.APITimeoutError):
            future.result(timeout=30)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            seconds = cancel_rounds(cluster, start_impatient, give_up, rounds=5)
        finally:
            control.close()
    report_cancels("OpenAI SDK non-streaming client timed out", seconds, 5)
    good_request_works(cluster, expected)


def test_openai_finish_reason_stop_at_eos_even_as_the_last_token(cluster, model, openai_client):
    """``stop`` when the model made end_id (the config's eos), also as its max_tokens-th
    token; ``length`` when max_tokens cut the text one token before."""
    tokenizer = load_tokenizer(model)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    want = _with_eos(model, PROMPTS[2:3], 64)[0]
    assert want[-1] == eos, "the reference makes no eos for this prompt within 64 tokens"
    for max_tokens, reason, ids in [(len(want), "stop", want),
                                    (len(want) - 1, "length", want[:-1])]:
        for stream in (False, True):
            answer = openai_client.completions.create(
                model=model.name, prompt=PROMPTS[2], max_tokens=max_tokens, temperature=0,
                stream=stream)
            choices = [c.choices[0] for c in answer] if stream else answer.choices
            assert "".join(c.text for c in choices) == tokenizer.decode(ids)
            assert choices[-1].finish_reason == reason, (max_tokens, stream)
