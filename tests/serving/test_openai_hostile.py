"""Hostile input against the real OpenAI API over a real 1P+1T cluster (and the ensemble's
stop / bad words over Triton gRPC): each case gets a 4xx in OpenAI's error shape (a clean
gRPC error) in under 1 s, and an 8-token request sent at the same time finishes in under
twice its time alone."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import PROMPTS, module_cluster, reference
from hostile_procs import stream
from tritonclient.utils import InferenceServerException

from clients.generate import stream_grpc
from orchestrator.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
HUGE = 20_000_000  # bytes of the huge prompt
SEND_PIECE = 1 << 20
ROUNDS = 5
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


cluster = module_cluster("openai-hostile", prefill=1, decode=1)


@pytest.fixture(scope="module")
def expected(model) -> str:
    """The single-process reference's greedy text (ignore_eos: all MAX_TOKENS tokens)."""
    return load_tokenizer(model).decode(reference(model, PROMPTS[:1], MAX_TOKENS)[0])


def request(cluster, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None, chunked: bool = False) -> tuple[int, dict]:
    """(status, JSON answer) of one HTTP request to the API, read as soon as it comes (a
    body refused early is still being sent then)."""
    connection = http.client.HTTPConnection("127.0.0.1", cluster.openai.port, timeout=30)
    try:
        connection.putrequest(method, path)
        sent_headers = {"Content-Type": "application/json", **(headers or {})}
        if chunked:
            sent_headers["Transfer-Encoding"] = "chunked"
        elif "Content-Length" not in sent_headers:
            sent_headers["Content-Length"] = str(len(body))
        for name, value in sent_headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        sock = connection.sock  # close() forgets it: the sender's sends then fail

        def send_body() -> None:  # beside the reading: the answer may come before the end
            try:
                for start in range(0, len(body), SEND_PIECE):
                    piece = body[start:start + SEND_PIECE]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # refused and closed before the whole body went out

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()  # a sender still sending stops at once


def completion(model, **fields) -> bytes:
    """A JSON body (ASCII: a lone surrogate goes out as its escape, ``\\ud800``)."""
    return json.dumps({"model": model.name, "max_tokens": MAX_TOKENS, **fields}).encode()


def normal(cluster, model, expected: str) -> None:
    status, answer = request(cluster, "POST", COMPLETIONS, completion(
        model, prompt=PROMPTS[0], temperature=0, ignore_eos=True))
    assert status == 200, answer
    assert answer["choices"][0]["text"] == expected  # token-exact


def timed(call: Callable[[], object]) -> tuple[float, object]:
    start = time.monotonic()
    result = call()
    return time.monotonic() - start, result


def beside(cluster, model, expected, hostile: Callable[[], object], rounds: int = ROUNDS
           ) -> tuple[float, float, float, object]:
    """(seconds until the hostile call answered, seconds the normal request took sent
    with it, and alone, the hostile call's last answer): medians of ``rounds``, each a
    normal request alone and then one beside the hostile call (on 2 shared cores, one
    70 ms request alone says little)."""
    refused, with_it, alone, answer = [], [], [], None
    for _ in range(rounds):
        alone.append(timed(lambda: normal(cluster, model, expected))[0])
        with ThreadPoolExecutor(1) as pool:
            took = pool.submit(timed, lambda: normal(cluster, model, expected))
            refused_s, answer = timed(hostile)
            with_it.append(took.result(timeout=60)[0])
        refused.append(refused_s)
    return (float(np.median(refused)), float(np.median(with_it)), float(np.median(alone)),
            answer)


def assert_openai_error(status: int, answer: dict, want_status: int, text: str) -> None:
    assert status == want_status, (status, answer)
    assert set(answer) == {"error"}, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert text in answer["error"]["message"], answer


HI = [{"role": "user", "content": "Hi"}]
# name: (route, the body's fields besides model and max_tokens, status, part of the message)
BODIES: dict[str, tuple[str, dict, int, str]] = {
    "prompt over the prompt byte limit": (
        COMPLETIONS, {"prompt": "w" * 1_000_000}, 400, "exceeds the prompt limit"),
    "lone surrogate in a prompt": (
        COMPLETIONS, {"prompt": "Hi \ud800"}, 400, "not valid Unicode"),
    "lone surrogate in a stop word": (
        COMPLETIONS, {"prompt": "Hi", "stop": ["\ud800"]}, 400, "not valid Unicode"),
    "lone surrogate in a chat message": (
        CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "not valid Unicode"),
    "max_tokens 4294967300": (
        COMPLETIONS, {"prompt": "Hi", "max_tokens": 4294967300}, 400, "less than or equal"),
    "max_tokens 10^12": (
        COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**12}, 400, "less than or equal"),
    "max_completion_tokens 2^40": (
        CHAT, {"messages": HI, "max_completion_tokens": 2**40}, 400, "less than or equal"),
    "n 10^12": (COMPLETIONS, {"prompt": "Hi", "n": 10**12}, 400, "less than or equal"),
    "seed 2^70": (COMPLETIONS, {"prompt": "Hi", "seed": 2**70}, 400, "less than"),
    "logprobs 10^12": (COMPLETIONS, {"prompt": "Hi", "logprobs": 10**12}, 400, "at most 5"),
    "top_logprobs 10^12": (
        CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 10**12}, 400, "at most 5"),
    "2,000 stop strings": (COMPLETIONS, {"prompt": "Hi", "stop": ["x"] * 2_000}, 400,
                           "at most 64"),
    "missing prompt": (COMPLETIONS, {}, 400, "prompt"),
    "fan-out of 1,024 sequences": (
        COMPLETIONS, {"prompt": ["Hi"] * 64, "n": 16, "max_tokens": 240}, 400,
        "at most 32 at once"),
}
# name: (method, route, body (None: a 20 MB prompt), chunked, status, part of the message)
RAW: dict[str, tuple[str, str, bytes | None, bool, int, str]] = {
    "20 MB prompt, Content-Length": ("POST", COMPLETIONS, None, False, 413, "exceeds the limit"),
    "20 MB prompt, chunked": ("POST", COMPLETIONS, None, True, 413, "exceeds the limit"),
    "bad JSON": ("POST", COMPLETIONS, b'{"model": ', False, 400, "JSON"),
    "not an object": ("POST", COMPLETIONS, b"[1, 2]", False, 400, ""),
    "wrong method": ("GET", COMPLETIONS, b"", False, 405, "Not Allowed"),
    "unknown route": ("POST", "/v1/nothing", b"{}", False, 404, "Not Found"),
}


def hostile_call(cluster, model, case: str) -> tuple[Callable[[], tuple[int, dict]], int, str]:
    """(the call, the status it must get, part of its message)."""
    if case in BODIES:
        route, fields, status, text = BODIES[case]
        body = completion(model, **fields)
        return lambda: request(cluster, "POST", route, body), status, text
    method, route, body, chunked, status, text = RAW[case]
    if body is None:
        body = json.dumps({"model": model.name, "prompt": "w" * HUGE, "max_tokens": 8}).encode()
    return lambda: request(cluster, method, route, body, chunked=chunked), status, text


@pytest.mark.parametrize("case", [*RAW, *BODIES])
def test_a_hostile_request_is_refused_at_once_and_costs_others_nothing(
        cluster, model, expected, case):
    hostile, status, text = hostile_call(cluster, model, case)
    normal(cluster, model, expected)  # warm
    refused_s, normal_s, alone_s, (got_status, answer) = beside(cluster, model, expected,
                                                                hostile)
    print(f"{case}: {got_status} in {refused_s * 1000:.0f} ms; an 8-token request beside "
          f"it {normal_s * 1000:.0f} ms, alone {alone_s * 1000:.0f} ms "
          f"(x{normal_s / alone_s:.2f})")
    assert_openai_error(got_status, answer, status, text)
    assert refused_s < 1.0, refused_s
    assert normal_s < 2 * alone_s, (normal_s, alone_s)


def test_fan_out_that_fits_is_queued_and_served_whole(cluster, model, expected):
    """Two requests of 32 sequences each (the cluster's 16 seats and 16 prompt slots) at
    once: every sequence is served, greedy and token-exact, none refused."""
    body = completion(model, prompt=[PROMPTS[0]] * 2, n=16, temperature=0,
                      ignore_eos=True)
    answers: list[tuple[int, dict]] = []
    threads = [threading.Thread(target=lambda: answers.append(
        request(cluster, "POST", "/v1/completions", body))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(answers) == 2
    for status, answer in answers:
        assert status == 200, answer
        assert [c["text"] for c in answer["choices"]] == [expected] * 32


# -- the ensemble over Triton gRPC: stop / bad words ----------------------------------------

def words_inputs(name: str, words: np.ndarray) -> list:
    """A request with these ``name`` words, serialized (seconds for millions of them: here,
    before any clock starts)."""
    inputs = []
    for input_name, array, dtype in (
            ("text_input", np.array([[b"Hi"]], np.object_), "BYTES"),
            ("max_tokens", np.array([[MAX_TOKENS]], np.int32), "INT32"),
            (name, words, "BYTES")):
        inputs.append(grpcclient.InferInput(input_name, list(array.shape), dtype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def words_request(cluster, inputs: list, model_name: str = "ensemble") -> str:
    """The error message ``model_name`` answers a request of :func:`words_inputs` with."""
    client = grpcclient.InferenceServerClient(cluster.frontend.grpc_url)
    try:
        list(stream(client, model_name, inputs))
    except InferenceServerException as exc:
        return exc.message()
    finally:
        client.close()
    raise AssertionError("the request was served")


@pytest.mark.parametrize(("name", "words", "text", "limit_s"), [
    # Triton's Python backend stub turns a BYTES input into numpy in a Python loop before
    # the model sees it (~3 us an element here): 2,000,000 cost seconds of CPU there,
    # whatever the model does (and slow others on 2 shared cores); the model then refuses
    # them by count before parsing any. Reported, not bounded.
    ("stop_words", np.array([[b"w"] * 2_000_000], np.object_), "at most 64", None),
    ("bad_words", np.array([[b"x" * 1_000_000]], np.object_), "at most 16384", 1.0),
], ids=["2,000,000 stop words", "a 1 MB bad word"])
def test_hostile_ensemble_words_are_refused_at_once(cluster, model, expected, name, words,
                                                    text, limit_s):
    normal(cluster, model, expected)  # warm
    inputs = words_inputs(name, words)
    refused_s, normal_s, alone_s, message = beside(
        cluster, model, expected, lambda: words_request(cluster, inputs), rounds=1)
    print(f"ensemble {name} {words.size} x {len(words.reshape(-1)[0])} B: refused in "
          f"{refused_s * 1000:.0f} ms; an 8-token request beside it {normal_s * 1000:.0f} ms, "
          f"alone {alone_s * 1000:.0f} ms (x{normal_s / alone_s:.2f})")
    assert text in message and "Traceback" not in message and "_csv" not in message, message
    if limit_s is not None:  # see the parameters: else the stub's cost is not the model's
        assert refused_s < limit_s, refused_s
        assert normal_s < 2 * alone_s, (normal_s, alone_s)


def stub_cpu_s(cluster, model_name: str) -> float:
    """CPU seconds the cluster's Python stubs of ``model_name`` (every instance) used."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if (b"triton_python_backend_stub" in command and str(cluster.run_dir).encode()
                in command and f"/{model_name}/1/model.py".encode() in command):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@pytest.mark.parametrize(("model_name", "stub"), [("ensemble", "preprocessing"),
                                                 ("tensorrt_llm_bls", "tensorrt_llm_bls")])
def test_stop_words_that_hold_a_stub_for_seconds_block_no_other_request(
        cluster, model, model_name, stub):
    """Triton 2.51's stub converts 2,000,000 ``stop_words`` to numpy (seconds of CPU)
    before the model's code refuses them, and a stub does one request at a time: with one
    instance of preprocessing (or tensorrt_llm_bls) another client's request to the same
    model waited for that refusal (measured x25, x51). With two, it is served by the
    other one meanwhile: sent once the hostile request holds a stub, it ends before that
    request is answered."""
    url = cluster.frontend.grpc_url
    want = reference(model, PROMPTS[:1], MAX_TOKENS)[0]

    def ensemble_request() -> None:
        assert [i for c in stream_grpc(url, PROMPTS[0], model=model_name,
                                       max_tokens=MAX_TOKENS) for i in c.ids] == want

    ensemble_request()  # warm
    alone_s = float(np.median([timed(ensemble_request)[0] for _ in range(3)]))
    hostile: dict[str, object] = {}
    inputs = words_inputs("stop_words", np.array([[b"w"] * 2_000_000], np.object_))

    def send() -> None:
        hostile["message"] = words_request(cluster, inputs, model_name)
        hostile["answered"] = time.monotonic()

    before = stub_cpu_s(cluster, stub)
    sender = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    sender.start()
    while stub_cpu_s(cluster, stub) - before < 0.3:  # a stub is converting them
        assert sender.is_alive() and time.monotonic() - started < 60, hostile
        time.sleep(0.02)
    beside_s, _ = timed(ensemble_request)
    served = time.monotonic()
    sender.join(timeout=60)
    assert "at most 64" in str(hostile["message"]), hostile
    print(f"2,000,000 {model_name} stop words: refused after "
          f"{hostile['answered'] - started:.1f} s; "
          f"an 8-token {model_name} request sent meanwhile {beside_s * 1000:.0f} ms, alone "
          f"{alone_s * 1000:.0f} ms (x{beside_s / alone_s:.2f}), ended "
          f"{hostile['answered'] - served:.1f} s before the refusal")
    assert served < hostile["answered"]  # not queued behind the busy stub
