"""Shared by the tests that start real tritonserver clusters."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from clients import breakdown, common
from clients.common import PROMPTS as ALL_PROMPTS
from clients.generate import GenerateError, stream_grpc, stream_http
from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import Cluster, read_state
from orchestrator.cluster.pid_watch import watching
from orchestrator.control.auth import load_secret
from orchestrator.control.client import ControlClient, is_unreachable
from orchestrator.engine.reference import generate, log_softmax_along
from orchestrator.engine.tokenizer import end_and_pad_ids, load_tokenizer
from orchestrator.engine.torch_engine import load_engine

MAX_SEQ_LEN = 256  # the tiny models' positions: room for a long stream to cancel
LONG = MAX_SEQ_LEN - 16  # max_tokens of a stream long enough to leave in the middle of
PROMPTS = ALL_PROMPTS[:6]


def cluster_up(model: Path, run_dir: Path, **kwargs) -> Cluster:
    """A cluster of real tritonservers on ``model`` at the tests' context length."""
    return Cluster.up(model, run_dir=run_dir, max_seq_len=MAX_SEQ_LEN, **kwargs)


def end_id(model_dir: Path) -> int | None:
    """The end token a text request without ``end_id`` ends at (the tokenizer's)."""
    return end_and_pad_ids(model_dir, load_tokenizer(model_dir))[0]


def reference(model_dir: Path, prompts: list[str], max_tokens: int, to_end: bool = True
              ) -> list[list[int]]:
    """Greedy tokens of the single-process reference on the same weights; ``to_end``: each
    ends at the tokenizer's end token (kept), as a text request (``ensemble``,
    ``tensorrt_llm_bls``) without ``end_id`` does; else all ``max_tokens`` (``end_id`` -1,
    or ``tensorrt_llm`` without one)."""
    return common.reference(model_dir, prompts, max_tokens, MAX_SEQ_LEN,
                            end_id(model_dir) if to_end else None)


def module_cluster(folder: str, up: Callable[..., object] = cluster_up, **kwargs):
    """A module-scoped fixture: one cluster, ``up(model, <tmp>/<folder>N, **kwargs)``, that
    the module's tests share (assign it to the fixture's name)."""

    @pytest.fixture(scope="module")
    def fixture(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
        with up(model, tmp_path_factory.mktemp(folder), **kwargs) as cluster:
            yield cluster

    return fixture


def module_reference(prompts: list[str], max_tokens: int, to_end: bool = True):
    """A module-scoped fixture: the reference's tokens for ``prompts`` (:func:`reference`;
    assign it to the fixture's name)."""

    @pytest.fixture(scope="module")
    def fixture(model: Path) -> list[list[int]]:
        return reference(model, prompts, max_tokens, to_end)

    return fixture


def run_concurrently(protocol: str, url: str, prompts: list[str], **params) -> list[list]:
    """Every prompt at once; each result is that request's list of chunks."""
    run = stream_grpc if protocol == "grpc" else stream_http
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(lambda p=p: list(run(url, p, **params))) for p in prompts]
        return [f.result(timeout=120) for f in futures]


def ids_concurrently(protocol: str, url: str, prompts: list[str], max_tokens: int,
                     **params) -> list[list[int]]:
    """Every prompt at once (:func:`run_concurrently`): each request's token ids."""
    return [ids_of(chunks) for chunks in run_concurrently(protocol, url, prompts,
                                                          max_tokens=max_tokens, **params)]


def stream_orchestrator(url: str, prompt_ids: list[int], max_tokens: int, secret: bytes):
    """Tokens straight from the frontend's orchestrator model, one response at a time."""
    return breakdown.stream_orchestrator(url, secret, prompt_ids, max_tokens)


def first_tokens(stream, n: int) -> list[int]:
    """The first ``n`` tokens of a stream of responses (of ``stream_grpc``'s chunks or
    ``stream_orchestrator``'s id lists): a stream that fell behind gets several in one."""
    got: list[int] = []
    while len(got) < n:
        chunk = next(stream)
        got += chunk if isinstance(chunk, list) else chunk.ids
    return got[:n]


def complete(cluster: Cluster, prompt: str, max_tokens: int, timeout_s: float = 10.0) -> str:
    """A greedy completion through the OpenAI API of the state file (raises if it is down)."""
    body = json.dumps({"model": cluster.model_dir.name, "prompt": prompt,
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    url = read_state(cluster.run_dir)["openai"]["url"]
    request = urllib.request.Request(f"{url}/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]


def ids_of(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.ids]


def text_of(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def metric(server, name: str, **labels: str) -> float:
    """Sum of a counter or gauge on a node's Prometheus port over series matching ``labels``."""
    return common.metric(f"127.0.0.1:{server.metrics_port}", name, **labels)


def eventually(read: Callable[[], float], done: Callable[[float], bool],
               timeout_s: float = 10.0) -> float:
    """``read()`` (a metric) once ``done`` holds for it: a node publishes its metrics from a
    thread of its own, so an update shows a moment late. Fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, f"still {value}"
        time.sleep(0.02)
    return value


def assert_log_probs_match_reference(url: str, model_dir: Path, prompt: str, max_tokens: int,
                                     top: int = 3) -> None:
    """gRPC, streaming and not: greedy tokens with ``return_log_probs`` equal the
    reference's, and each token's log-prob (and the ``top`` likeliest) equal the
    reference model's log-softmax at its position; ``cum_log_probs`` sums them so far."""
    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, max_seq_len=MAX_SEQ_LEN)
    prompt_ids = tokenizer.encode(prompt).ids
    want_ids = generate([engine], [prompt_ids], max_tokens)[0]
    rows = log_softmax_along([engine], prompt_ids, want_ids)
    want = rows[range(len(want_ids)), want_ids].tolist()
    best = rows.topk(top, dim=-1)
    for stream in (True, False):
        chunks = list(stream_grpc(url, prompt, stream=stream, max_tokens=max_tokens,
                                  return_log_probs=True, top_log_probs=top))
        assert [t for c in chunks for t in c.ids] == want_ids
        got = [p for c in chunks for p in c.log_probs]
        assert np.allclose(got, want, atol=1e-4), (stream, got, want)
        sums = np.cumsum(got)[np.cumsum([len(c.ids) for c in chunks]) - 1]
        assert np.allclose([c.cum_log_prob for c in chunks], sums, atol=1e-4)
        alternatives = [pair for c in chunks for pair in c.top]
        assert [[i for i, _ in a] for a in alternatives] == best.indices.tolist()
        assert np.allclose([[p for _, p in a] for a in alternatives], best.values, atol=1e-4)
    plain = list(stream_grpc(url, prompt, max_tokens=max_tokens))
    assert [t for c in plain for t in c.ids] == want_ids
    assert all(c.log_probs is None and c.top is None for c in plain)  # none unless asked


def t_nodes_held(cluster, control: ControlClient) -> dict[str, int]:
    """What requests hold on the T-nodes (each one's own ``held`` report, summed): all 0
    when no request runs."""
    total: dict[str, int] = {}
    for node in cluster.role("decode"):
        for what, count in json.loads(control.call(node.server.grpc_url, "held")).items():
            total[what] = total.get(what, 0) + count
    return total


def cancel_rounds(cluster, start, leave, rounds: int, timeout_s: float = 2.0) -> list[float]:
    """``rounds`` times: ``start()`` a long request (reading its first tokens), ``leave()``
    it; the seconds from leaving to the T-nodes holding nothing, for the rounds whose
    T-node was still generating when the client left (a fast T-node may have made every
    token by then: nothing is left to cancel in that round; ``leave`` returns False when
    it saw the request end whole before its leaving took). The T-nodes must have counted
    a cancellation for at least one of those rounds."""
    stage0 = [node.server for node in cluster.role("decode") if node.config.stage == 0]
    cancelled_before = sum(metric(s, "dejavu_requests", outcome="cancelled") for s in stage0)
    seconds = []
    control = ControlClient(load_secret(cluster.secret_file), 30.0)  # one channel per node
    try:
        for _ in range(rounds):
            request = start()
            generating = t_nodes_held(cluster, control)["clients"] == 1
            left = time.monotonic()
            if leave(request) is False:
                generating = False
            deadline = left + timeout_s
            while any((held := t_nodes_held(cluster, control)).values()):
                assert time.monotonic() < deadline, f"the T-nodes still hold {held}"
                time.sleep(0.02)
            if generating:
                seconds.append(time.monotonic() - left)
    finally:
        control.close()
    if seconds:  # some T-node counted a cancellation
        eventually(lambda: sum(metric(s, "dejavu_requests", outcome="cancelled")
                               for s in stage0), lambda n: n > cancelled_before)
    return seconds


def report_cancels(what: str, seconds: list[float], rounds: int) -> None:
    assert seconds, f"{what}: no round was still generating when the client left"
    print(f"\n{what}: leave -> T-node free, {len(seconds)} of {rounds} rounds still "
          f"generating: median {sorted(seconds)[len(seconds) // 2] * 1000:.0f} ms, "
          f"max {max(seconds) * 1000:.0f} ms")


# -- stages killed mid-stream ------------------------------------------------------------

FAULT_TOKENS = 120  # long enough to be mid-stream when a stage dies
FIXED = {"end_id": -1}  # no end token: a stream runs to max_tokens (reference to_end=False)
DEAD_AFTER_S = 3.0
# A sampled request: the seeded sampler must resume after a recovery as if nothing failed.
SEEDED = dict(temperature=1.0, top_k=50, seed=7, min_tokens=FAULT_TOKENS, **FIXED)


class Streaming(threading.Thread):
    """One streamed request of a fixed length (:data:`FIXED`: it is mid-stream when a stage
    dies); its chunks as they come."""

    def __init__(self, url: str, prompt: str, **params) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.params = {"max_tokens": FAULT_TOKENS, **FIXED, **params}
        self.chunks, self.error = [], None
        self.arrivals: list[float] = []  # monotonic seconds, one per chunk

    def run(self) -> None:
        try:
            for chunk in stream_grpc(self.url, self.prompt, **self.params):
                self.chunks.append(chunk)
                self.arrivals.append(time.monotonic())
        except GenerateError as exc:
            self.error = exc


def longest_gap(requests: list[Streaming]) -> float:
    """The longest wait any of these clients saw between two of its responses (s)."""
    return max((b - a for r in requests for a, b in itertools.pairwise(r.arrivals)),
               default=0.0)


def kill_mid_stream(cluster: Cluster, prompts: list[str],
                    victims: list[str] | Callable[[], list[str]], after_tokens: int = 8,
                    seeded: str | None = None, max_tokens: int = FAULT_TOKENS) -> list[Streaming]:
    """Stream every prompt (and ``seeded`` with :data:`SEEDED` sampling, last); once each
    has ``after_tokens`` tokens, kill ``victims`` (or those it names then); wait until
    every stream ended."""
    requests = [Streaming(cluster.frontend.grpc_url, p, max_tokens=max_tokens)
                for p in prompts]
    requests += [Streaming(cluster.frontend.grpc_url, seeded, **SEEDED)] if seeded else []
    # The supervisor still importing (seconds after `up` on a loaded machine) would act only
    # once it runs: the clients' pause would measure its start, not the recovery.
    deadline = time.monotonic() + 120
    while not watching(cluster.run_dir):
        assert time.monotonic() < deadline, "the supervisor does not watch its nodes"
        time.sleep(0.05)
    for r in requests:
        r.start()
    deadline = time.monotonic() + 60
    while not all(len(ids_of(r.chunks)) >= after_tokens for r in requests):
        assert time.monotonic() < deadline, "no tokens before the kill"
        time.sleep(0.05)
    for name in victims() if callable(victims) else victims:
        assert chaos.main(["kill", name, "--dir", str(cluster.run_dir)]) == 0
    for r in requests:
        r.join(150)
        assert not r.is_alive()
    return requests


def fault_cluster(model, run_dir, **kwargs):
    """A cluster of one P-node and token pipelines that notice a lost node in 3 s."""
    return cluster_up(model, run_dir, prefill=1,
                      dead_after_s=DEAD_AFTER_S, controller_timeout_s=DEAD_AFTER_S, **kwargs)


def held(cluster: Cluster, suffix: str = "") -> dict[str, dict[str, int]]:
    """What each T-stage (whose name ends with ``suffix``) holds now (its ``held``
    report), by node name."""
    stages = [n for n in read_state(cluster.run_dir)["nodes"]
              if n["role"] == "decode" and n["name"].endswith(suffix)]
    return {n["name"]: _held_by(cluster, n["grpc"]) for n in stages}


def _held_by(cluster: Cluster, url: str, tries: int = 3) -> dict[str, int]:
    """One node's ``held`` report. On a loaded host (16 nodes on 2 cores) a live node's
    gRPC handshake may time out (UNAVAILABLE): asked again on a new channel, up to ``tries``
    times; a node that stays unreachable still raises."""
    for _ in range(tries - 1):
        try:
            return _ask_held(cluster, url)
        except InferenceServerException as exc:
            if not is_unreachable(exc):
                raise
    return _ask_held(cluster, url)


def _ask_held(cluster: Cluster, url: str) -> dict[str, int]:
    control = ControlClient(load_secret(cluster.secret_file), 10.0)
    try:
        return json.loads(control.call(url, "held"))
    finally:
        control.close()


def assert_all_freed(cluster: Cluster) -> None:
    """No stage holds KV, replicas or restored KV once every request ended."""
    deadline = time.monotonic() + 15
    while True:
        now = held(cluster)
        if all(v == 0 for h in now.values() for v in h.values()):
            return
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
