"""Shared by the tests that start real tritonserver clusters."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from clients.generate import stream_grpc, stream_http
from orchestrator.control.auth import sign_prompt
from orchestrator.control.client import tensor
from orchestrator.engine.reference import generate
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.engine.torch_engine import load_engine

MAX_SEQ_LEN = 256  # the tiny models' positions: room for a long stream to cancel
PROMPTS = [
    "The quick brown fox",
    "Where is the server?",
    "A pipeline splits the layers of a model into stages",
    "0, 1, 2, 3",
    "How many tokens per second",
    "Large language models answer a prompt in two phases.",
]


def reference(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the single-process reference on the same weights."""
    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, max_seq_len=MAX_SEQ_LEN)
    return generate([engine], [tokenizer.encode(p).ids for p in prompts], max_tokens)


def run_concurrently(protocol: str, url: str, prompts: list[str], **params) -> list[list]:
    """Every prompt at once; each result is that request's list of chunks."""
    run = stream_grpc if protocol == "grpc" else stream_http
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(lambda p=p: list(run(url, p, **params))) for p in prompts]
        return [f.result(timeout=120) for f in futures]


def stream_orchestrator(url: str, prompt_ids: list[int], max_tokens: int, secret: bytes):
    """Tokens straight from the frontend's orchestrator model, one response at a time (its
    input signed as preprocessing signs it)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    signature = sign_prompt(secret, np.array(prompt_ids, dtype=np.int32).tobytes())
    arrays = {"input_ids": np.array([prompt_ids], np.int32),
              "input_lengths": np.array([[len(prompt_ids)]], np.int32),
              "input_auth": np.array([[signature.encode()]], dtype=np.object_),
              "max_tokens": np.array([[max_tokens]], np.int32), "stream": np.array([[True]])}
    tensors = [tensor(name, array) for name, array in arrays.items()]
    client.async_stream_infer("orchestrator", tensors)
    try:
        while True:
            result, error = responses.get(timeout=30)
            assert error is None, error
            yield result.as_numpy("output_ids").reshape(-1).tolist()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def ids_of(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.ids]


def text_of(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def metric(server, name: str, **labels: str) -> float:
    """Sum of a counter or gauge on a node's Prometheus port over series matching ``labels``."""
    import re
    import urllib.request

    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total
