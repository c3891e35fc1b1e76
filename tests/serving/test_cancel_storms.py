"""Cancel storms crash no node: 3,000 clients of a real 1P+1T cluster leave mid-request, 30 at
a time, half as gRPC stream cancellations to the ensemble, half as HTTP ``generate_stream``
clients that close their socket; each leaves after 0-2 chunks (during admission, the
prefill or the decode).

Between our own nodes nothing is ever cancelled over gRPC (the frontend ends a request on
the T-node with the signed ``end`` op, and the P-node reads the ended KV slot), so no
internal call can meet Triton 2.51's cancellation race (server issues 7368 and 8034).
Every node keeps its process (none crashed and was started again), nothing is held at the
end, and a request after the storms is token-exact.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import PROMPTS, cluster_up, ids_of, reference
from test_hostile import until_nothing_held

from clients.generate import _inputs, stream_grpc
from orchestrator.cluster.launcher import read_state
from orchestrator.cluster.tritonserver import alive
from orchestrator.control.client import stop_stream

pytestmark = pytest.mark.slow
CANCELS, STORM = 3_000, 30
# More than any client waits for (it leaves mid-request), and few: Triton 2.51's ensemble
# passes a cancellation on only between its steps, so every token after a client left still
# reaches the gRPC handler of a cancelled stream, and each is a chance for that handler's own
# race with the cancellation (server issues 7368, 8034; it aborted the frontend once at 64
# tokens, after 1,590 cancels).
MAX_TOKENS = 12
CHUNK_WAIT_S = 10.0  # longest wait for a chunk (a storm queues for the T-node's slots)


def leave_grpc(url: str, prompt: str, chunks: int) -> None:
    """A gRPC stream to the ensemble, cancelled after ``chunks`` responses."""
    got: list = []
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: got.append(error or result))
        client.async_stream_infer("ensemble", _inputs([prompt], True, {"max_tokens": MAX_TOKENS}),
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + CHUNK_WAIT_S
        while len(got) < chunks and time.monotonic() < deadline:
            time.sleep(0.002)
        stop_stream(client, cancel=True)
    finally:
        client.close()


def leave_http(address: str, prompt: str, chunks: int) -> None:
    """A ``generate_stream`` client that closes its socket after ``chunks`` events."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=CHUNK_WAIT_S)
    try:
        body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True})
        connection.request("POST", "/v2/models/ensemble/generate_stream", body)
        response = connection.getresponse()
        assert response.status == 200
        for _ in range(chunks):
            while not response.readline().startswith(b"data:"):
                pass
        connection.sock.shutdown(socket.SHUT_RDWR)
    finally:
        connection.close()


def test_3000_client_cancels_in_storms_of_30_crash_no_node(model, tmp_path):
    expected = reference(model, PROMPTS[:1], 8)[0]
    with cluster_up(model, tmp_path, prefill=1, decode=1) as cluster:
        pids = {n["name"]: n["pid"] for n in read_state(tmp_path)["nodes"]}
        grpc_url, http_url = cluster.frontend.grpc_url, cluster.frontend.http_url
        rng = random.Random(31)
        plan = [(i % 2, PROMPTS[rng.randrange(len(PROMPTS))], rng.randrange(3))
                for i in range(CANCELS)]

        def leave(how: int, prompt: str, chunks: int) -> None:
            if how == 0:
                leave_grpc(grpc_url, prompt, chunks)
            else:
                leave_http(http_url, prompt, chunks)

        start = time.monotonic()
        with ThreadPoolExecutor(STORM) as pool:
            for first in range(0, CANCELS, STORM):  # a storm: 30 at once, then the next
                list(pool.map(lambda args: leave(*args), plan[first:first + STORM]))
                assert all(alive(pid) for pid in pids.values()), first
        took = time.monotonic() - start
        print(f"{CANCELS} cancels ({CANCELS // 2} gRPC, {CANCELS // 2} HTTP) in storms of "
              f"{STORM}: {took:.0f} s")
        state = read_state(tmp_path)
        assert {n["name"]: n["pid"] for n in state["nodes"]} == pids  # none started again
        assert all(alive(pid) for pid in pids.values())
        until_nothing_held(cluster, timeout_s=30)
        chunks = list(stream_grpc(grpc_url, PROMPTS[0], max_tokens=8))
        assert ids_of(chunks) == expected
