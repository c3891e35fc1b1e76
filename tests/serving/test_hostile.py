"""A hostile but ordinary client against a real 1P+1T cluster: nothing it sends takes the
service down, and nothing is left behind.

Each case gets a clear client error (HTTP 400 / gRPC INVALID_ARGUMENT) at once and is
followed by a normal request; what the nodes hold is counted from their own reports (the
T-node's ``held`` control op, the P-node's ``dejavu_held`` gauge) and from /proc and
/dev/shm.
"""

from __future__ import annotations

import glob
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import (
    MAX_SEQ_LEN,
    PROMPTS,
    ids_of,
    metric,
    reference,
    stream_orchestrator,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from clients.generate import GenerateError, stream_grpc
from orchestrator.cluster.launcher import Cluster
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.frontend import control

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hostile")
    with Cluster.up(model, prefill=1, decode=1, run_dir=run_dir, max_seq_len=MAX_SEQ_LEN) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model):
    return reference(model, PROMPTS[:1], MAX_TOKENS)[0]


def post(cluster, body: bytes, endpoint: str = "generate") -> tuple[int, bytes]:
    url = f"http://{cluster.frontend.http_url}/v2/models/ensemble/{endpoint}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def normal_request_works(cluster, expected) -> None:
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected


def held(cluster) -> dict[str, float]:
    """What requests hold on the nodes; every value 0 when nothing leaked."""
    decode, prefill = cluster.role("decode")[0].server, cluster.role("prefill")[0].server
    counts = json.loads(control(decode.grpc_url, "held", 10))
    counts["staging_blocks"] = metric(prefill, "dejavu_held", what="staging_blocks")
    counts["frontend_queue"] = metric(cluster.frontend, "dejavu_queue_length")
    return counts


def until_nothing_held(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(held(cluster).values()):
        assert time.monotonic() < deadline, held(cluster)
        time.sleep(0.05)


def footprint(cluster) -> dict[str, tuple[int, int, int]]:
    """Per node: threads and child processes of its tritonserver and stubs, /dev/shm files."""
    out = {}
    for node in cluster.nodes:
        server = node.server
        pids = [server.process.pid, *children(server.process.pid)]
        threads = sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids
                      if os.path.exists(f"/proc/{pid}"))
        out[server.name] = (threads, len(pids), len(glob.glob(f"/dev/shm/{server.shm_prefix}*")))
    return out


def children(pid: int) -> list[int]:
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(task) as f:
            found += [int(p) for p in f.read().split()]
    return found + [g for c in found for g in children(c)]


def test_nan_temperature_is_refused_and_the_service_stays_up(cluster, expected):
    """Before: the P-node's sampling failed, its staging block leaked, the frontend ran it
    again every second for 60 s, and then every request failed 'no free KV slot'."""
    for _ in range(20):  # more than the P-node's 16 staging blocks
        status, body = post(cluster, b'{"text_input": "Hi", "max_tokens": 8, '
                                      b'"temperature": NaN}')
        assert status == 400, body
        assert b"temperature must be a finite number" in body
    with pytest.raises(GenerateError, match="finite"):
        list(stream_grpc(cluster.frontend.grpc_url, "Hi", max_tokens=8, temperature=np.nan))
    until_nothing_held(cluster)
    normal_request_works(cluster, expected)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(cluster, expected):
    status, body = post(cluster, json.dumps({"text_input": "word " * 10_000_000,
                                             "max_tokens": 8}).encode())
    assert status == 400, body
    assert b"exceeds the limit" in body
    # Token ids straight to the frontend's model are refused by count.
    client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
    ids = grpcclient.InferInput("input_ids", [2_000_000], "INT32")
    ids.set_data_from_numpy(np.ones(2_000_000, dtype=np.int32))
    tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([8], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="does not fit"):
        list(_stream(client, "orchestrator", [ids, tokens]))
    until_nothing_held(cluster)
    normal_request_works(cluster, expected)


def _stream(client, model_name: str, inputs):
    """Every response of one decoupled request; raises its error."""
    import queue

    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model_name, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=30)
            if error is not None:
                raise error
            yield result
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_request_without_max_tokens_gets_a_clear_error(cluster, expected, endpoint):
    status, body = post(cluster, b'{"text_input": "Hi", "stream": true}', endpoint)
    assert 400 <= status < 500, (status, body)
    assert b"max_tokens" in body
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hi"], dtype=np.object_))
    client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
    with pytest.raises(InferenceServerException, match="max_tokens"):
        list(_stream(client, "ensemble", [text]))
    normal_request_works(cluster, expected)


def test_cancelled_streams_leave_the_t_node_at_once(cluster, model, expected):
    """A cancelled gRPC stream to the frontend's orchestrator model ends the request on the
    T-node (its slot and microbatch seat are free) within a few hundred ms."""
    prompt_ids = load_tokenizer(model).encode(PROMPTS[0]).ids
    seconds = []
    for _ in range(10):
        stream = stream_orchestrator(cluster.frontend.grpc_url, prompt_ids, MAX_SEQ_LEN - 32)
        next(stream)
        next(stream)  # the T-node is generating
        assert held(cluster)["clients"] == 1
        cancelled = time.monotonic()
        stream.close()
        until_nothing_held(cluster, timeout_s=5)
        seconds.append(time.monotonic() - cancelled)
    print(f"cancel -> T-node free: median {sorted(seconds)[5] * 1000:.0f} ms, "
          f"max {max(seconds) * 1000:.0f} ms")
    normal_request_works(cluster, expected)


def test_a_thousand_bad_cancelled_and_failing_requests_leave_nothing(cluster, model, expected):
    normal_request_works(cluster, expected)  # every model has served once: stubs are grown
    before = footprint(cluster)
    prompt_ids = load_tokenizer(model).encode(PROMPTS[1]).ids
    prefill_url = cluster.role("prefill")[0].server.grpc_url
    bad_bodies = [b'{"text_input": "Hi", "max_tokens": 8, "temperature": NaN}',
                  b'{"text_input": "Hi", "max_tokens": 0}',
                  b'{"text_input": "", "max_tokens": 8}',
                  b'{"text_input": "Hi", "max_tokens": 8, "top_p": 2.5}',
                  b'{"text_input": "Hi", "max_tokens": 100000}',
                  b'{"text_input": "Hi"}',
                  b'{"text_input": "Hi", "max_tokens": "eight"}',
                  b'{"max_tokens": 8}']

    def bad(i: int) -> None:
        status, body = post(cluster, bad_bodies[i % len(bad_bodies)])
        assert 400 <= status < 500, (status, body)

    def cancelled(i: int) -> None:
        stream = stream_orchestrator(cluster.frontend.grpc_url, prompt_ids, MAX_SEQ_LEN - 32)
        next(stream)
        stream.close()

    def failing(i: int) -> None:  # a prefill with a forged KV ticket: the P-node refuses it
        client = grpcclient.InferenceServerClient(prefill_url)
        inputs = []
        for name, array, dtype in (("input_ids", np.array(prompt_ids, np.int32), "INT32"),
                                   ("max_tokens", np.array([4], np.int32), "INT32"),
                                   ("kv_ticket", np.array([b"forged"], np.object_), "BYTES")):
            inputs.append(grpcclient.InferInput(name, list(array.shape), dtype))
            inputs[-1].set_data_from_numpy(array)
        with pytest.raises(InferenceServerException):
            client.infer("prefill", inputs, client_timeout=30)
        client.close()

    kinds = [bad] * 7 + [cancelled] * 2 + [failing]
    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(kinds[i % len(kinds)], i) for i in range(1000)]:
            future.result(timeout=120)
    until_nothing_held(cluster)
    normal_request_works(cluster, expected)
    deadline = time.monotonic() + 15
    while True:  # threads of ended requests exit on their own
        after = footprint(cluster)
        grew = {name: (before[name], now) for name, now in after.items()
                if now[0] > before[name][0] + 4 or now[1:] != before[name][1:]}
        if not grew:
            break
        assert time.monotonic() < deadline, f"(threads, processes, shm) grew: {grew}"
        time.sleep(0.5)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats()
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                       children, max_size=3),
    max_leaves=6,
)
FIELDS = ["text_input", "max_tokens", "temperature", "top_k", "top_p", "random_seed",
          "end_id", "stream", "beam_width"]


@settings(max_examples=int(os.environ.get("DEJAVU_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
       endpoint=st.sampled_from(["generate", "generate_stream"]))
def test_fuzzed_http_requests_get_an_answer_or_a_client_error(cluster, body, endpoint):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS  # a valid request stays short
    encoded = json.dumps(body, allow_nan=True).encode()
    status, answer = post(cluster, encoded, endpoint)
    assert status == 200 or 400 <= status < 500, (status, answer)


@settings(max_examples=int(os.environ.get("DEJAVU_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_tokens=st.integers(-2**31, 2**31 - 1), temperature=st.floats(width=32),
       top_p=st.floats(width=32), top_k=st.integers(-2**31, 2**31 - 1),
       text=st.binary(max_size=64))
def test_fuzzed_grpc_requests_get_an_answer_or_a_client_error(cluster, max_tokens, temperature,
                                                               top_p, top_k, text):
    values = {"text_input": (np.array([text], np.object_), "BYTES"),
              "max_tokens": (np.array([min(max_tokens, MAX_TOKENS)], np.int32), "INT32"),
              "temperature": (np.array([temperature], np.float32), "FP32"),
              "top_p": (np.array([top_p], np.float32), "FP32"),
              "top_k": (np.array([top_k], np.int32), "INT32")}
    inputs = []
    for name, (array, dtype) in values.items():
        inputs.append(grpcclient.InferInput(name, [1], dtype))
        inputs[-1].set_data_from_numpy(array)
    client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
    try:
        list(_stream(client, "ensemble", inputs))
    except InferenceServerException as exc:
        assert "INVALID_ARG" in str(exc.status()) or exc.status() is None, exc
    finally:
        client.close()


def test_after_the_fuzzing_nothing_is_held(cluster, expected):
    until_nothing_held(cluster)
    normal_request_works(cluster, expected)
