"""A hostile but ordinary client against a real 1P+1T cluster: nothing it sends takes the
service down, and nothing is left behind.

Each case gets a clear client error (HTTP 400 / gRPC INVALID_ARGUMENT) at once and is
followed by a normal request; what the nodes hold is counted from their own reports (the
T-node's ``held`` control op, the P-node's ``dejavu_held`` gauge).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
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
    first_tokens,
    ids_of,
    metric,
    module_cluster,
    reference,
    stream_orchestrator,
)
from hostile_procs import huge_prompt_sender, stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spawned import Child
from tritonclient.utils import InferenceServerException

from clients.common import process_groups
from clients.generate import GenerateError, stream_grpc
from orchestrator.control.auth import load_secret, request_parameters
from orchestrator.control.client import ControlClient, raise_for_error, tensor
from orchestrator.control.errors import ControlError
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.frontend import request_arrays
from orchestrator.serving.params import HONOURED, NEUTRAL, GenerationParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
RESERVE_TTL_S = 5.0
HUGE_PROMPT_BYTES = 50_000_000
HUGE_ROUNDS = 5  # an unused KV slot reservation on the T-node is freed after this


cluster = module_cluster("hostile", prefill=1, decode=1, reserve_ttl_s=RESERVE_TTL_S)


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


@pytest.fixture(scope="module")
def usual_s(cluster, expected) -> float:
    """How long a normal request takes on this cluster: the median of five, after a warm-up."""
    return float(np.median([_timed(lambda: _normal_request(cluster, expected))
                            for _ in range(6)][1:]))


def _normal_request(cluster, expected) -> None:
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected


def normal_request_works(cluster, expected, usual_s: float) -> None:
    """Token-exact, and within 1 s of its usual time."""
    took = _timed(lambda: _normal_request(cluster, expected))
    assert took < usual_s + 1.0, f"{took:.2f} s, usually {usual_s:.2f} s"


def held(cluster) -> dict[str, float]:
    """What requests hold on the nodes; every value 0 when nothing leaked."""
    decode, prefill = cluster.role("decode")[0].server, cluster.role("prefill")[0].server
    control = ControlClient(load_secret(cluster.secret_file), 10.0)
    counts = json.loads(control.call(decode.grpc_url, "held"))
    counts["staging_blocks"] = metric(prefill, "dejavu_held", what="staging_blocks")
    counts["frontend_queue"] = metric(cluster.frontend, "dejavu_queue_length")
    return counts


def until_nothing_held(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(held(cluster).values()):
        assert time.monotonic() < deadline, held(cluster)
        time.sleep(0.05)


def test_nan_temperature_is_refused_and_the_service_stays_up(cluster, expected, usual_s):
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
    normal_request_works(cluster, expected, usual_s)


def test_a_request_without_max_tokens_is_refused_naming_it(cluster, expected, usual_s):
    """Before (max_tokens a required input): Triton answered generate with 200 and an error
    text, generate_stream with an empty 200, and a gRPC stream waited for ever."""
    for endpoint in ("generate", "generate_stream"):
        status, body = post(cluster, b'{"text_input": "Hi"}', endpoint)
        assert status == 400, (endpoint, body)
        assert b"max_tokens is required" in body, endpoint
    for model_name in ("ensemble", "tensorrt_llm_bls"):
        with pytest.raises(GenerateError, match="max_tokens is required"):
            list(stream_grpc(cluster.frontend.grpc_url, "Hi", model=model_name))
    until_nothing_held(cluster)
    normal_request_works(cluster, expected, usual_s)


def test_abandoned_kv_slot_reservations_expire(cluster, expected, usual_s):
    """Signed ``reserve`` control ops that are never used (a client that reserved and left)
    hold every KV slot of the T-node only until their time is up."""
    control = ControlClient(load_secret(cluster.secret_file), 10.0)
    decode = cluster.role("decode")[0].server
    reserved = 0
    with pytest.raises(ControlError, match="no free KV slot"):
        while reserved <= 256:
            control.call(decode.grpc_url, "reserve", request_id=f"abandoned-{reserved}",
                         prompt_ids=[1, 2, 3])
            reserved += 1
    assert held(cluster)["slots"] == reserved > 0
    until_nothing_held(cluster, timeout_s=RESERVE_TTL_S + 5)
    deadline = time.monotonic() + 5  # a short grace for a late writer, then the slots are back
    while True:
        try:
            control.call(decode.grpc_url, "reserve", request_id="probe", prompt_ids=[1, 2, 3])
            break
        except ControlError:
            assert time.monotonic() < deadline, "the expired slots did not come back"
            time.sleep(0.1)
    control.call(decode.grpc_url, "release", request_id="probe")
    normal_request_works(cluster, expected, usual_s)


def test_a_huge_prompt_is_refused_at_once_beside_a_normal_request(cluster, expected, usual_s):
    """A 50 MB prompt over gRPC is refused before it is tokenized; a normal request sent at
    the same time is timed against one sent alone (medians of several rounds). The huge
    prompt comes from another process: built and sent in this one, it held the GIL and
    slowed the measuring client, not the service. The targets (refused within 1 s, 10%)
    are reported, not asserted: on 2 shared cores the bounds here are looser."""
    # Triton 2.51's HTTP server itself crashes on bodies of a few MB (its issue 5840): 1 MB.
    status, body = post(cluster, json.dumps({"text_input": "word " * 200_000,
                                             "max_tokens": 8}).encode())
    assert status == 400, body
    assert b"exceeds the limit" in body
    sender = Child(huge_prompt_sender, cluster.frontend.grpc_url, HUGE_PROMPT_BYTES)
    try:
        sender.answer()
        sender.call("send")  # warm: the channel, and the stubs' shm grown to the size once
        alone, beside, refused = [], [], []
        for _ in range(HUGE_ROUNDS):
            alone.append(_timed(lambda: _normal_request(cluster, expected)))
            sender.inbox.put(("send",))
            beside.append(_timed(lambda: _normal_request(cluster, expected)))
            seconds, error = sender.answer()
            assert "exceeds the limit" in error, error
            refused.append(seconds)
    finally:
        sender.close()
    ratio = np.median(beside) / np.median(alone)
    print(f"{HUGE_PROMPT_BYTES / 1e6:.0f} MB prompt refused in {np.median(refused):.2f} s "
          f"(median of {HUGE_ROUNDS}, max {max(refused):.2f} s); a normal request "
          f"{np.median(alone) * 1000:.0f} ms alone, {np.median(beside) * 1000:.0f} ms beside "
          f"it: x{ratio:.2f}")
    # Loose bounds (the machine is shared): before, such a prompt took 120 s to be refused
    # and the request beside it waited as long.
    assert np.median(refused) < 5.0, refused
    assert np.median(beside) < 1.5 * np.median(alone) + 0.1, (alone, beside)
    until_nothing_held(cluster)
    normal_request_works(cluster, expected, usual_s)


def _timed(call) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_cancelled_streams_leave_the_t_node_at_once(cluster, model, expected, usual_s):
    """A cancelled gRPC stream to the frontend's orchestrator model ends the request on the
    T-node (its slot and microbatch seat are free) within a few hundred ms, and the frontend's
    tritonserver lets its connection go. Before, a request cancelled while it still
    generated never got its final flag: Triton kept the stream, and its socket, for ever
    (one fd per such client; the soak's frontend grew ~6 a minute)."""
    prompt_ids = load_tokenizer(model).encode(PROMPTS[0]).ids
    frontend = cluster.frontend.process.pid
    fds_before = open_fds(frontend)
    seconds = []
    for _ in range(20):
        stream = stream_orchestrator(cluster.frontend.grpc_url, prompt_ids, MAX_SEQ_LEN - 32,
                                     load_secret(cluster.secret_file))
        first_tokens(stream, 2)
        # The T-node does not wait for the client: a fast one may have made all its tokens
        # by now, and then there is nothing left to cancel in this round.
        generating = held(cluster)["clients"] == 1
        cancelled = time.monotonic()
        stream.close()
        until_nothing_held(cluster, timeout_s=5)
        if generating:
            seconds.append(time.monotonic() - cancelled)
    assert len(seconds) >= 5, f"only {len(seconds)} of 20 streams were still generating"
    print(f"cancel -> T-node free ({len(seconds)} streams): median "
          f"{sorted(seconds)[len(seconds) // 2] * 1000:.0f} ms, max {max(seconds) * 1000:.0f} ms")
    deadline = time.monotonic() + 10  # the server closes a connection its client closed
    while open_fds(frontend) > fds_before + 2:  # room for a connection of another client
        assert time.monotonic() < deadline, (fds_before, open_fds(frontend))
        time.sleep(0.1)
    normal_request_works(cluster, expected, usual_s)


FUZZ = settings(max_examples=int(os.environ.get("DEJAVU_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)
# Mostly the right type (so that requests get past Triton's own checks), any JSON sometimes.
FIELD = {"int": st.integers(-2**31, 2**31 - 1), "float": st.floats(width=32),
         "bool": st.booleans(), "str": st.text(max_size=300)}
FIELDS = {**HONOURED, **{name: kind for name, (kind, _) in NEUTRAL.items()},
          "lora_task_id": "int"}
BODIES = st.fixed_dictionaries(
    {"text_input": st.text(max_size=64) | JSON},
    optional={**{name: FIELD[kind] | JSON for name, kind in FIELDS.items()},
              "stop_words": st.lists(st.text(max_size=8), max_size=3) | JSON,
              "bad_words": st.lists(st.text(max_size=8), max_size=3) | JSON,
              "no_such_input": JSON})


@FUZZ
@given(max_tokens=st.integers(-2**31, 2**31 - 1), temperature=st.floats(width=32),
       top_p=st.floats(width=32), top_k=st.integers(-2**31, 2**31 - 1),
       text=st.binary(max_size=64))
def test_fuzzed_grpc_requests_get_an_answer_or_a_client_error(cluster, max_tokens, temperature,
                                                               top_p, top_k, text):
    values = {"text_input": (np.array([[text]], np.object_), "BYTES"),
              "max_tokens": (np.array([[min(max_tokens, MAX_TOKENS)]], np.int32), "INT32"),
              "temperature": (np.array([[temperature]], np.float32), "FP32"),
              "top_p": (np.array([[top_p]], np.float32), "FP32"),
              "top_k": (np.array([[top_k]], np.int32), "INT32")}
    inputs = []
    for name, (array, dtype) in values.items():
        inputs.append(grpcclient.InferInput(name, [1, 1], dtype))  # [batch, 1]
        inputs[-1].set_data_from_numpy(array)
    client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
    try:
        list(stream(client, "ensemble", inputs))
    except InferenceServerException as exc:
        assert "INVALID_ARG" in str(exc.status()) or exc.status() is None, exc
    finally:
        client.close()


@FUZZ
@given(body=BODIES, endpoint=st.sampled_from(["generate", "generate_stream"]))
def test_fuzzed_http_requests_get_an_answer_or_a_client_error(cluster, body, endpoint):
    for name in ("max_tokens", "num_return_sequences"):  # answers stay short
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], MAX_TOKENS if name == "max_tokens" else 2)
    status, answer = post(cluster, json.dumps(body).encode(), endpoint)
    # Triton 2.51 itself answers 500 where a value does not convert to its input's type
    # ("Unable to parse JSON bytes array", ...): the request never reaches a model.
    assert status in (200, 400) or (status == 500 and b"parse" in answer.lower()), (status,
                                                                                   answer)
    if status == 200:
        events = [json.loads(line.removeprefix(b"data:")) for line in answer.splitlines()
                  if line.strip()]
        assert events and all("text_output" in event for event in events), answer


@FUZZ
@given(body=st.binary(max_size=256) | st.text(max_size=256).map(str.encode)
       | JSON.map(lambda value: json.dumps(value).encode()[:-1]),  # cut short
       endpoint=st.sampled_from(["generate", "generate_stream"]))
def test_fuzzed_malformed_http_bodies_are_refused(cluster, body, endpoint):
    """Not a JSON object of inputs: refused (by Triton itself, 500 for a body its JSON
    parser rejects, see the README) and the server stays up."""
    status, answer = post(cluster, body, endpoint)
    assert status in (400, 500), (status, answer)
    assert b"error" in answer, answer


def test_after_the_fuzzing_nothing_is_held(cluster, expected, usual_s):
    until_nothing_held(cluster)
    normal_request_works(cluster, expected, usual_s)


# -- 1,000 mixed bad, cancelled and failing requests ----------------------------------------

BAD_BODIES = [  # each kind of refusal at the edge (HTTP 400)
    {"text_input": "Hi", "max_tokens": 8, "temperature": float("nan")},
    {"text_input": "Hi"},
    {"text_input": "Hi", "max_tokens": 0},
    {"text_input": "Hi", "max_tokens": 100_000},
    {"text_input": "Hi", "max_tokens": 8, "top_p": 2.0},
    {"text_input": "Hi", "max_tokens": 8, "top_k": -1},
    {"text_input": "Hi", "max_tokens": 8, "end_id": 10**6},
    {"text_input": "Hi", "max_tokens": 8, "beam_width": 2},
    {"text_input": "Hi", "max_tokens": 8, "lora_task_id": 1},
    {"text_input": "word " * 1_000, "max_tokens": 8},  # over the prompt byte limit
]


def usage(cluster) -> dict[str, dict[str, int]]:
    """Per node (its tritonserver's process group, stubs included), from /proc: threads,
    open fds, processes, and its /dev/shm regions. Its tritonserver's orphaned sockets are
    counted apart from the fds (see :func:`orphaned_sockets`)."""
    groups = process_groups()
    found = {}
    for node in cluster.nodes:
        server = node.server
        orphaned = orphaned_sockets(server.process.pid)
        group = groups[server.process.pid]
        found[server.name] = {**group, "fds": group["fds"] - orphaned, "orphaned": orphaned,
                              "shm": len(server.shm_regions())}
    return found


def orphaned_sockets(pid: int) -> int:
    """Socket fds of ``pid`` that no kernel socket table lists any more: connections closed
    whose fd the process never closed. Triton 2.51's own HTTP/gRPC servers keep a few of
    these after clients leave mid-stream (3-9 per 1,000-request round here, also before
    the frontend ended T-node requests itself): counted, bounded, kept apart."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    for table, column in (("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6)):
        with open(f"/proc/net/{table}") as f:
            inodes -= {line.split()[column] for line in f.read().splitlines()[1:]}
    return len(inodes)


def test_a_thousand_mixed_requests_leave_nothing_behind(cluster, model, expected, usual_s):
    """Bad requests (each kind of refusal, over HTTP and gRPC), generate_stream clients
    that leave after their first tokens, and prefills that fail on the
    P-node (expired KV tickets), 16 at a time. Counted from the nodes' own reports and
    /proc: no slot, staging block, thread, fd, /dev/shm region or process stays behind."""
    secret = load_secret(cluster.secret_file)
    prompt_ids = load_tokenizer(model).encode(PROMPTS[0]).ids
    control = ControlClient(secret, 10.0)
    decode = cluster.role("decode")[0].server.grpc_url
    tickets = {f"expired-{i}": control.call(decode, "reserve", request_id=f"expired-{i}",
                                            prompt_ids=prompt_ids) for i in range(4)}
    until_nothing_held(cluster, timeout_s=RESERVE_TTL_S + 5)
    prefill_url = cluster.role("prefill")[0].server.grpc_url
    prefill = grpcclient.InferenceServerClient(prefill_url)

    def bad(i: int) -> None:
        body = BAD_BODIES[i % len(BAD_BODIES)]
        status, answer = post(cluster, json.dumps(body).encode(),
                              ("generate", "generate_stream")[i % 2])
        assert status == 400, (body, answer)

    def bad_grpc(i: int) -> None:
        with pytest.raises(GenerateError):
            list(stream_grpc(cluster.frontend.grpc_url, "Hi", max_tokens=8, top_p=2.0))

    def cancelled(i: int) -> None:
        # A generate_stream client that leaves after its first token: the frontend cancels
        # its stream to the T-node. (Not gRPC cancels to the frontend, 220 a run: Triton
        # 2.51's gRPC frontend has a cancellation race that can crash it, upstream PR 8078;
        # a fresh-clone run hit it here once. test_cancelled_streams_... cancels over gRPC.)
        host, port = cluster.frontend.http_url.split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            body = json.dumps({"text_input": PROMPTS[0], "max_tokens": MAX_SEQ_LEN - 32,
                               "stream": True})
            connection.request("POST", "/v2/models/tensorrt_llm_bls/generate_stream", body)
            response = connection.getresponse()
            assert response.status == 200
            while not response.readline().startswith(b"data:"):
                pass
            connection.sock.shutdown(socket.SHUT_RDWR)
        finally:
            connection.close()

    def failing(i: int) -> None:
        request_id = f"expired-{i % len(tickets)}"
        arrays = {**request_arrays(prompt_ids, GenerationParams(MAX_TOKENS)),
                  "kv_ticket": np.array([tickets[request_id]], np.object_)}
        result = prefill.infer("prefill", [tensor(k, v) for k, v in arrays.items()],
                               request_id=request_id, parameters=request_parameters(
                                   secret, "prefill", "prefill", request_id, prefill_url,
                                   arrays))
        with pytest.raises(ControlError, match="ticket expired"):
            raise_for_error(result, "prefill")

    kinds = [bad] * 6 + [bad_grpc] + [cancelled] * 2 + [failing]  # of every 10
    # Warm with the same 1,000: the pools of connections (and their threads) and the shm
    # regions grow to what this load needs once (100 left them short of it: +17 threads).
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: kinds[i % len(kinds)](i), range(1_000)))
    until_nothing_held(cluster)
    before = usage(cluster)
    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: kinds[i % len(kinds)](i), range(1_000)))
    took = time.monotonic() - start
    prefill.close()
    until_nothing_held(cluster)
    # The frontend's HTTP server closes the connections of the clients that left a moment
    # after their requests end: poll until each node is back within bounds, or 10 s.
    deadline = time.monotonic() + 10
    while (grown := leftovers(before, after := usage(cluster))) and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"1,000 mixed requests in {took:.1f} s; per node before -> after: "
          + "; ".join(f"{name} {before[name]} -> {after[name]}" for name in after))
    assert not grown, grown
    normal_request_works(cluster, expected, usual_s)


def leftovers(before: dict, after: dict) -> list:
    """What a node holds beyond its count before: no process, /dev/shm region, more than a
    few fds or threads (pools may add a few; the frontend leaked a thread per cancelled
    stream, ~200 here, before control.client.stop_stream), or orphaned sockets for more
    than one in ten of the round's 200 leaving clients."""
    return [(name, before[name], counts) for name, counts in after.items()
            if counts["processes"] != before[name]["processes"]
            or counts["shm"] > before[name]["shm"]
            or counts["fds"] > before[name]["fds"] + 8
            or counts["orphaned"] > before[name]["orphaned"] + 20
            or counts["threads"] > before[name]["threads"] + 16]
