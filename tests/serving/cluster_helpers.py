"""Shared by the tests that start real tritonserver clusters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clients import breakdown, common
from clients.common import PROMPTS as ALL_PROMPTS
from clients.generate import stream_grpc, stream_http

MAX_SEQ_LEN = 256  # the tiny models' positions: room for a long stream to cancel
PROMPTS = ALL_PROMPTS[:6]


def reference(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the single-process reference on the same weights."""
    return common.reference(model_dir, prompts, max_tokens, MAX_SEQ_LEN)


def run_concurrently(protocol: str, url: str, prompts: list[str], **params) -> list[list]:
    """Every prompt at once; each result is that request's list of chunks."""
    run = stream_grpc if protocol == "grpc" else stream_http
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(lambda p=p: list(run(url, p, **params))) for p in prompts]
        return [f.result(timeout=120) for f in futures]


def stream_orchestrator(url: str, prompt_ids: list[int], max_tokens: int, secret: bytes):
    """Tokens straight from the frontend's orchestrator model, one response at a time."""
    return breakdown.stream_orchestrator(url, secret, prompt_ids, max_tokens)


def ids_of(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.ids]


def text_of(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def metric(server, name: str, **labels: str) -> float:
    """Sum of a counter or gauge on a node's Prometheus port over series matching ``labels``."""
    return common.metric(f"127.0.0.1:{server.metrics_port}", name, **labels)
