"""A client that leaves while its prompt is prefilling stops the prefill on the P-node.

Real tritonservers (a frontend, one P-node, one T-node) serve a tiny Llama made deep
and wide (many layers, a wide MLP) so that a near-context prompt takes long enough to
prefill for the client to leave in the middle of it. The frontend never cancels its call to
the P-node (Triton 2.51 races a cancellation against a response): it ends the request on the
T-node (a signed op), whose KV slot then reads ended, and the P-node, which reads it between
layers, stops after the layer in progress; the P-node's own reports (its metrics) say
it stopped early and holds nothing, and the next request's tokens are the reference's.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time

import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import (
    MAX_SEQ_LEN,
    PROMPTS,
    cluster_up,
    ids_of,
    metric,
    reference,
    t_nodes_held,
)

from clients.breakdown import signed_request
from clients.generate import stream_grpc
from orchestrator.control.auth import load_secret
from orchestrator.control.client import ControlClient, stop_stream
from orchestrator.engine.checkpoint import make_checkpoint
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.params import GenerationParams

pytestmark = pytest.mark.slow
LAYERS = 64  # many layers: the prefill is stoppable after each
# A wide MLP makes each layer's compute, not the machine's load, what makes the prefill long:
# ~1 s on one core here, against a cancel chain of ~50-150 ms.
INTERMEDIATE = 8192
MAX_TOKENS = 8
ROUNDS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint("llama", "tiny", tmp_path_factory.mktemp("deep-llama"),
                           num_hidden_layers=LAYERS, intermediate_size=INTERMEDIATE)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("prefill-cancel")
    # One prompt KV slot on the T-node: each round's request needs the slot the round
    # before cancelled, so a P-node that stopped must say it writes nothing more (else the
    # slot waits out the KV timeout, 30 s, for a late write).
    with cluster_up(model, run_dir, prefill=1, decode=1, num_slots=1) as c:
        yield c


def _until(done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _count(server, outcome: str) -> float:
    return metric(server, "dejavu_requests", outcome=outcome)


def _held(server) -> float:
    return (metric(server, "dejavu_held", what="prompts")
            + metric(server, "dejavu_held", what="staging_blocks"))


def _leave_mid_prefill(cluster, start, leave) -> float:
    """``start()`` a request, ``leave(it)`` once the P-node is prefilling it; the seconds
    until the P-node stopped the prefill and holds nothing."""
    prefill = cluster.role("prefill")[0].server
    before = {outcome: _count(prefill, outcome) for outcome in ("cancelled", "finished")}
    request = start()
    try:
        _until(lambda: metric(prefill, "dejavu_held", what="prompts") == 1, 10,
               "the P-node never started the prompt")
    finally:
        left = time.monotonic()
        leave(request)
    _until(lambda: any(_count(prefill, outcome) > count for outcome, count in before.items())
           and not _held(prefill), 10, "the P-node still holds the prompt's resources")
    seconds = time.monotonic() - left
    assert _count(prefill, "cancelled") > before["cancelled"], (
        f"the prefill ran to its end, {seconds * 1000:.0f} ms after the client left")
    return seconds


def test_a_client_that_leaves_mid_prefill_stops_the_p_node(cluster, model):
    """A gRPC cancel on the frontend's orchestrator model, and an OpenAI client that
    disconnects (the API cancels its gRPC stream to tensorrt_llm_bls). Triton 2.51's HTTP
    frontend sees a generate_stream client gone only when it writes the first token: that
    prefill runs to its end (the README says so)."""
    prefill = cluster.role("prefill")[0].server
    secret = load_secret(cluster.secret_file)
    tokenizer = load_tokenizer(model)
    ids = random.Random(0).choices(range(5, 500), k=MAX_SEQ_LEN - MAX_TOKENS)
    text = tokenizer.decode(tokenizer.encode(" ".join(PROMPTS * 40)).ids[:len(ids) - 8])
    assert len(ids) - 16 < len(tokenizer.encode(text).ids) <= len(ids)

    def start_grpc():
        client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        params = GenerationParams(max_tokens=MAX_TOKENS, stream=True)
        client.async_stream_infer(
            "orchestrator", signed_request(secret, ids, params)["inputs"])
        return client

    def cancel_grpc(client) -> None:
        try:
            stop_stream(client, cancel=True)
        finally:
            client.close()

    def start_openai():
        """An OpenAI client, raw: its socket is what leaves."""
        connection = http.client.HTTPConnection("127.0.0.1", cluster.openai.port, timeout=30)
        body = json.dumps({"model": model.name, "prompt": text, "max_tokens": MAX_TOKENS,
                           "temperature": 0, "stream": True})
        connection.request("POST", "/v1/completions", body,
                           {"Content-Type": "application/json"})
        return connection

    def disconnect(connection) -> None:
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()

    finished_before = _count(prefill, "finished")
    control = ControlClient(secret, 30.0)
    seconds: dict[str, list[float]] = {"gRPC cancel (orchestrator)": [],
                                       "OpenAI client gone (/v1/completions)": []}
    try:
        for _ in range(ROUNDS):
            for (start, leave), times in zip([(start_grpc, cancel_grpc),
                                              (start_openai, disconnect)], seconds.values(),
                                             strict=True):
                times.append(_leave_mid_prefill(cluster, start, leave))
                _until(lambda: not any(t_nodes_held(cluster, control).values()), 10,
                       "the T-node still holds the cancelled request")
    finally:
        control.close()
    assert _count(prefill, "finished") == finished_before  # each stopped before its end
    for what, times in seconds.items():
        print(f"\n{what} mid-prefill -> P-node free ({ROUNDS} rounds, {LAYERS} layers): "
              f"median {sorted(times)[ROUNDS // 2] * 1000:.0f} ms, "
              f"max {max(times) * 1000:.0f} ms")
    expected = reference(model, PROMPTS[:1], MAX_TOKENS)[0]
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected
