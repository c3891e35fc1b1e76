"""The TensorRT-LLM backend's stock clients' usage, against a real cluster.

The requests are built as ``end_to_end_grpc_client.py`` and
``inflight_batcher_llm_client.py`` (tensorrtllm_backend, inflight_batcher_llm/client)
build them, with their default flags, and the answers read as they read them:
``as_numpy("text_output")[0].decode("utf-8")``, ``batch_index[0][0]``,
``output_ids[0][0]``, ``sequence_length[0][0]``. The defaults (temperature 1.0, beam width
1, no top-k; the token client's top-k 1 and top-p 0) are greedy, so the text and ids are the
single-process reference's.
"""

from __future__ import annotations

import json
import queue
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import MAX_SEQ_LEN, PROMPTS, ids_of, module_cluster, reference
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from clients import common
from clients.generate import stream_grpc, stream_http
from clients.perf import install_tools, run_perf_analyzer
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
TIMEOUT_S = 120.0


cluster = module_cluster("trtllm-clients", prefill=1, decode=1)


@pytest.fixture(scope="module")
def eos(model) -> int:
    return ModelConfig.from_dir(model).eos_id


@pytest.fixture(scope="module")
def expected(model):
    """Greedy reference ids, ending at the tokenizer's end token: the text client sends no
    end id, and the ensemble then ends at the tokenizer's, as the backend's preprocessing
    fills it in."""
    return reference(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected_to_end(model, eos):
    """Greedy reference ids, each ending at the end id as a request that sends it does."""
    return common.reference(model, PROMPTS, MAX_TOKENS, MAX_SEQ_LEN, eos_id=eos)


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    made = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    made.set_data_from_numpy(array)
    return made


def stream(url: str, model: str, inputs: dict[str, np.ndarray],
           outputs: list[str] | None = None) -> list:
    """One request on a gRPC stream, as both clients send it; every result, in order
    (stop_stream waits for the last response); fails on an error."""
    got = answers(url, model, inputs, outputs)
    errors = [r.message() for r in got if isinstance(r, InferenceServerException)]
    assert not errors, errors
    return got


def answers(url: str, model: str, inputs: dict[str, np.ndarray],
            outputs: list[str] | None = None) -> list:
    """Every result and error of one request on a gRPC stream."""
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result),
                                             results), stream_timeout=TIMEOUT_S)
        client.async_stream_infer(
            model, [tensor(k, v) for k, v in inputs.items()],
            outputs=[grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None)
        client.stop_stream()
    return [results.get_nowait() for _ in range(results.qsize())]


def text_request(prompts: list[str], streaming: bool) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client's prepare_inputs with its default flags, rows stacked as
    --batch-inputs stacks them."""
    rows = len(prompts)
    return {"text_input": np.array([[p] for p in prompts]).astype(object),
            "max_tokens": np.full((rows, 1), MAX_TOKENS, np.int32),
            "stream": np.full((rows, 1), streaming),
            "beam_width": np.full((rows, 1), 1, np.int32),
            "temperature": np.full((rows, 1), 1.0, np.float32),
            "exclude_input_in_output": np.full((rows, 1), False)}


@pytest.mark.parametrize("model_name", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize(("mode", "streaming"), [("single", False), ("streaming", True),
                                                  ("batched", False),
                                                  ("batched", True)])
def test_end_to_end_client_gets_the_reference_text(cluster, model, expected, model_name, mode,
                                                   streaming):
    prompts = PROMPTS[:3] if mode == "batched" else PROMPTS[:1]
    outputs = ["text_output", "batch_index"] if mode == "batched" else ["text_output"]
    texts = [""] * len(prompts)
    for result in stream(cluster.frontend.grpc_url, model_name,
                         text_request(prompts, streaming), outputs):
        output = result.as_numpy("text_output")
        batch_index = result.as_numpy("batch_index")
        batch_index = 0 if batch_index is None else batch_index[0][0]
        if streaming:
            texts[batch_index] += output[0].decode("utf-8")
        else:
            texts[batch_index] = output[0].decode("utf-8")
    tokenizer = load_tokenizer(model)
    prompt_ids = [tokenizer.encode(p).ids for p in prompts]
    # Without streaming the text holds the prompt (exclude_input_in_output false).
    want = [tokenizer.decode(([] if streaming else ids) + new, skip_special_tokens=True)
            for ids, new in zip(prompt_ids, expected, strict=False)]
    assert texts == want


def token_request(rows: list[list[int]], streaming: bool, eos: int, pad: int
                  ) -> dict[str, np.ndarray]:
    """inflight_batcher_llm_client's prepare_inputs with its default flags (and
    --num-return-sequences 1, which puts a non-streaming request on the stream too);
    several rows padded with pad_id as a batched token client pads them."""
    ids = np.full((len(rows), max(map(len, rows))), pad, np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    n = len(rows)
    return {"input_ids": ids, "input_lengths": np.array([[len(r)] for r in rows], np.int32),
            "request_output_len": np.full((n, 1), MAX_TOKENS, np.int32),
            "beam_width": np.full((n, 1), 1, np.int32),
            "temperature": np.full((n, 1), 1.0, np.float32),
            "streaming": np.full((n, 1), streaming),
            "end_id": np.full((n, 1), eos, np.int32), "pad_id": np.full((n, 1), pad, np.int32),
            "runtime_top_k": np.full((n, 1), 1, np.int32),
            "runtime_top_p": np.full((n, 1), 0.0, np.float32),
            "num_return_sequences": np.full((n, 1), 1, np.int32)}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("streaming", [False, True])
def test_token_client_gets_the_reference_ids(cluster, model, expected_to_end, eos, rows,
                                             streaming):
    tokenizer = load_tokenizer(model)
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS[:rows]]
    got: list[list[int]] = [[] for _ in range(rows)]
    for result in stream(cluster.frontend.grpc_url, "tensorrt_llm",
                         token_request(prompt_ids, streaming, eos, pad=0)):
        output_ids = result.as_numpy("output_ids")
        assert result.as_numpy("sequence_index")[0][0] == 0
        row = result.as_numpy("batch_index")[0][0]
        length = result.as_numpy("sequence_length")[0][0]
        assert output_ids.shape == (1, 1, length)
        got[row] += list(output_ids[0][0])
    # Streaming: only the new tokens; else the prompt and then the new tokens.
    assert got == [([] if streaming else ids) + new
                   for ids, new in zip(prompt_ids, expected_to_end, strict=False)]


def test_without_end_id_text_requests_end_at_the_tokenizers_end_token_token_ones_do_not(
        cluster, model):
    """The backend's preprocessing fills a missing END_ID with the tokenizer's end token, so
    ``ensemble`` and ``tensorrt_llm_bls`` (which calls preprocessing) stop there; ``end_id``
    -1 runs on to max_tokens, and so does ``tensorrt_llm`` called without ``end_id`` (no
    end token, as the backend's). A prompt whose greedy text ends early shows it."""
    max_tokens = 64
    to_end = reference(model, PROMPTS, max_tokens)
    i = next(i for i, ids in enumerate(to_end) if len(ids) < max_tokens)
    full = reference(model, PROMPTS[i:i + 1], max_tokens, to_end=False)[0]
    assert full[: len(to_end[i])] == to_end[i] and len(full) == max_tokens
    grpc, http = cluster.frontend.grpc_url, cluster.frontend.http_url
    for name in ("ensemble", "tensorrt_llm_bls"):
        for streaming in (True, False):
            assert ids_of(stream_grpc(grpc, PROMPTS[i], streaming, name,
                                      max_tokens=max_tokens)) == to_end[i], (name, streaming)
        assert ids_of(stream_http(http, PROMPTS[i], False, name,
                                  max_tokens=max_tokens)) == to_end[i], name
        assert ids_of(stream_grpc(grpc, PROMPTS[i], True, name, max_tokens=max_tokens,
                                  end_id=-1)) == full, name
    request = token_request([load_tokenizer(model).encode(PROMPTS[i]).ids], True, 0, 0)
    request = {k: v for k, v in request.items() if k not in ("end_id", "pad_id")}
    request["request_output_len"][:] = max_tokens
    got = stream(grpc, "tensorrt_llm", request)
    assert [t for r in got for t in r.as_numpy("output_ids")[0][0]] == full


def test_postprocessing_decodes_the_token_models_ids(cluster, model, expected):
    tokenizer = load_tokenizer(model)
    tokens = np.array([[expected[0]]], np.int32)
    with grpcclient.InferenceServerClient(cluster.frontend.grpc_url) as client:
        result = client.infer("postprocessing", [
            tensor("TOKENS_BATCH", tokens),
            tensor("SEQUENCE_LENGTH", np.array([[len(expected[0])]], np.int32))])
    assert result.as_numpy("OUTPUT")[0].decode() == tokenizer.decode(
        expected[0], skip_special_tokens=True)


def test_token_model_refuses_what_it_cannot_do_and_serves_on(cluster, model, expected_to_end,
                                                              eos):
    tokenizer = load_tokenizer(model)
    prompt = [tokenizer.encode(PROMPTS[0]).ids]
    for name, value, message in [
        ("draft_input_ids", np.array([[1, 2]], np.int32), "speculative decoding"),
        ("beam_width", np.array([[2]], np.int32), "beam_width 2 is not supported"),
        ("runtime_top_p", np.array([[1.5]], np.float32), "top_p must be in [0, 1]"),
        *[("input_lengths", np.array([[length]], np.int32), "is not the number of ids sent")
          for length in (-1, len(prompt[0]) - 1, len(prompt[0]) + 1, 2**31 - 1)],
    ]:
        got = answers(cluster.frontend.grpc_url, "tensorrt_llm",
                      token_request(prompt, True, eos, 0) | {name: value})
        assert len(got) == 1 and isinstance(got[0], InferenceServerException)
        assert name in got[0].message() and message in got[0].message()
    got = stream(cluster.frontend.grpc_url, "tensorrt_llm", token_request(prompt, True, eos, 0))
    assert [t for r in got for t in r.as_numpy("output_ids")[0][0]] == expected_to_end[0]


def test_perf_analyzer_streams_the_token_models_reference_ids(cluster, model, expected_to_end,
                                                              eos, tmp_path):
    """``perf_analyzer -m tensorrt_llm`` with an input_ids JSON, as a token workload runs it;
    the tools come from scripts/perf_tools.sh (a failed install fails the test)."""
    prompt = load_tokenizer(model).encode(PROMPTS[0]).ids
    data = {"data": [{"input_ids": {"content": prompt, "shape": [len(prompt)]},
                      "input_lengths": [len(prompt)], "request_output_len": [MAX_TOKENS],
                      "streaming": [True], "end_id": [eos], "pad_id": [0]}]}
    point = run_perf_analyzer(install_tools(), cluster.frontend.grpc_url, "disaggregated", 2, 4,
                              len(expected_to_end[0]), "", tmp_path, "tensorrt_llm", data)
    assert point.requests == 4 and point.tokens == 4 * len(expected_to_end[0])
    export = json.loads((tmp_path / "export.json").read_text())
    for request in export["experiments"][0]["requests"]:
        streamed = [np.ravel(r["output_ids"]).tolist() for r in request["response_outputs"]]
        assert [t for ids in streamed for t in ids] == expected_to_end[0]


# -- tensorrt_llm deployed non-decoupled (the backend's decoupled_mode:false) --------------

unary = module_cluster("trtllm-unary", prefill=1, decode=1, trtllm_decoupled=False)


def test_a_non_decoupled_tensorrt_llm_answers_a_unary_infer_with_every_token(
        unary, model, expected_to_end, eos):
    """``--trtllm-decoupled false``: the token client's default mode (no ``--streaming``), a
    unary ModelInfer over gRPC and over HTTP, gets one response holding the prompt and every
    new token; the ensemble still streams."""
    import tritonclient.http as httpclient

    prompt = load_tokenizer(model).encode(PROMPTS[0]).ids
    request = token_request([prompt], False, eos, 0)
    want = prompt + expected_to_end[0]
    with grpcclient.InferenceServerClient(unary.frontend.grpc_url) as client:
        config = client.get_model_config("tensorrt_llm").config
        assert not config.model_transaction_policy.decoupled
        result = client.infer("tensorrt_llm", [tensor(k, v) for k, v in request.items()],
                              client_timeout=TIMEOUT_S)
    assert result.as_numpy("output_ids")[0][0].tolist() == want
    assert result.as_numpy("sequence_length")[0][0] == len(want)
    with httpclient.InferenceServerClient(unary.frontend.http_url,
                                          network_timeout=TIMEOUT_S) as client:
        inputs = []
        for name, array in request.items():
            inputs.append(httpclient.InferInput(name, list(array.shape),
                                                np_to_triton_dtype(array.dtype)))
            inputs[-1].set_data_from_numpy(array)
        result = client.infer("tensorrt_llm", inputs)
    assert result.as_numpy("output_ids")[0][0].tolist() == want
    assert ids_of(stream_grpc(unary.frontend.grpc_url, PROMPTS[0],
                              max_tokens=MAX_TOKENS)) == expected_to_end[0]


def test_a_non_decoupled_tensorrt_llm_refuses_streaming_and_batches_and_serves_on(
        unary, model, expected_to_end, eos):
    """As the backend refuses them when not decoupled: ``streaming`` true, and a request of
    several sequences (one response carries one); both INVALID_ARGUMENT, named."""
    tokenizer = load_tokenizer(model)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:2]]
    with grpcclient.InferenceServerClient(unary.frontend.grpc_url) as client:
        for request, message in ((token_request(prompts[:1], True, eos, 0),
                                  "streaming is only supported if tensorrt_llm is deployed "
                                  "decoupled"),
                                 (token_request(prompts, False, eos, 0), "2 sequences")):
            with pytest.raises(InferenceServerException, match=message) as refused:
                client.infer("tensorrt_llm", [tensor(k, v) for k, v in request.items()],
                             client_timeout=TIMEOUT_S)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        request = token_request(prompts[:1], False, eos, 0)
        result = client.infer("tensorrt_llm", [tensor(k, v) for k, v in request.items()],
                              client_timeout=TIMEOUT_S)
    assert result.as_numpy("output_ids")[0][0].tolist() == prompts[0] + expected_to_end[0]
