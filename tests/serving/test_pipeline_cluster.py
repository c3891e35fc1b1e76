"""Token pipelines on real tritonservers: D_t T-nodes, one stage each, linked by NIXL.

A P-node prefills on D_p prompt stages (in its one process) and streams each
layer's KV to the T-stage that holds it, so D_p != D_t regroups the KV on the
way. Tokens come out exactly as the single-process reference makes them, for
more concurrent requests than the pipeline has slots, with different
``max_tokens`` (early stops refill slots mid-run), with swapping on and off.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_helpers import (
    LONG,
    MAX_SEQ_LEN,
    PROMPTS,
    assert_log_probs_match_reference,
    cancel_rounds,
    cluster_up,
    first_tokens,
    ids_of,
    report_cancels,
)

from clients.generate import generate_batch, stream_grpc
from orchestrator.cluster.devices import Devices
from orchestrator.cluster.launcher import (
    down_main,
    spread_devices,
    status_main,
    up_main,
)
from orchestrator.engine.reference import generate
from orchestrator.engine.sampling import SamplingParams
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.engine.torch_engine import load_engine

pytestmark = pytest.mark.slow
# 6 requests, 2 per microbatch: a depth-2 pipeline holds 4 at a time, so 2 wait for a slot
LIMITS = [3, 9, 1, 12, 5, 7]


@pytest.fixture(scope="module")
def expected(model):
    tokenizer = load_tokenizer(model)
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    return [generate([engine], [tokenizer.encode(p).ids], n)[0]
            for p, n in zip(PROMPTS, LIMITS, strict=True)]


def run_all(url: str) -> list[list[int]]:
    """Every prompt at once, each with its own max_tokens."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(lambda p=p, n=n: ids_of(stream_grpc(url, p, max_tokens=n)))
                   for p, n in zip(PROMPTS, LIMITS, strict=True)]
        return [f.result(timeout=120) for f in futures]


def test_decode_depth_2_with_swapping_matches_reference(model, expected, tmp_path):
    with cluster_up(model, tmp_path, prefill=1, decode=1, decode_depth=2, swap="on",
                    max_batch=2) as cluster:
        stages = [(n.config.pipeline, n.config.stage, n.config.depth)
                  for n in cluster.role("decode")]
        assert stages == [(0, 0, 2), (0, 1, 2)]
        url = cluster.frontend.grpc_url
        assert run_all(url) == expected
        assert run_all(url) == expected  # the pipeline's slots and KV all came back
        contract_holds(model, cluster)
        cancel_reaches_every_stage(cluster)


def cancel_reaches_every_stage(cluster) -> None:
    """A cancelled tensorrt_llm_bls stream frees the request on both T-stages (slots, KV,
    replicas), as their own ``held`` reports say."""
    def start():
        stream = stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], model="tensorrt_llm_bls",
                             max_tokens=LONG)
        first_tokens(stream, 2)
        return stream

    seconds = cancel_rounds(cluster, start, lambda stream: stream.close(), rounds=5)
    report_cancels("gRPC cancel on tensorrt_llm_bls, depth-2 token pipeline", seconds, 5)


def contract_holds(model, cluster) -> None:
    """The TensorRT-LLM contract and the OpenAI API on a depth-2 pipeline: a batch of 4 in
    one call (through the ensemble and tensorrt_llm_bls), parameters the P-node and both
    T-stages must keep (a penalty, a seed), and log-probs."""
    import openai

    tokenizer = load_tokenizer(model)
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:4]]
    url = cluster.frontend.grpc_url
    for entry in ("ensemble", "tensorrt_llm_bls"):
        chunks = generate_batch(url, PROMPTS[:4], max_tokens=8, model=entry)
        assert [ids_of(chunks[(row, 0)]) for row in range(4)] == generate([engine], prompts, 8)
    penalty = SamplingParams(repetition_penalty=1.5)
    got = ids_of(stream_grpc(url, PROMPTS[3], max_tokens=16, repetition_penalty=1.5))
    assert got == generate([engine], prompts[3:], 16, sampling=penalty)[0]
    seeded = dict(max_tokens=10, top_k=50, seed=4, num_return_sequences=2)
    def samples() -> dict[tuple[int, int], list[int]]:
        return {key: ids_of(c) for key, c in generate_batch(url, PROMPTS[:1], **seeded).items()}

    first = samples()
    assert first == samples() and first[(0, 0)] != first[(0, 1)]
    assert_log_probs_match_reference(url, model, PROMPTS[5], 10)
    client = openai.OpenAI(base_url=cluster.openai.url, api_key="unused", max_retries=0)
    done = client.completions.create(model=model.name, prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    assert done.choices[0].text == tokenizer.decode(generate([engine], prompts[:1], 8, eos)[0])


def _cli(main, argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{stat}/stat").read_text()
                parents[int(stat)] = int(text.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += [child for child, parent in parents.items() if parent == found[-1]]
    return found


def _allowed_cores(pid: int) -> set[frozenset[int]]:
    """The CPU masks of every thread of every process from ``pid`` down."""
    masks = set()
    for proc in _descendants(pid):
        for task in os.listdir(f"/proc/{proc}/task"):
            masks.add(frozenset(os.sched_getaffinity(int(task))))
    return masks


def test_up_from_a_spec_prefill_depth_2_decode_depth_3(model, expected, tmp_path):
    """A planner spec (the format of ``Plan.to_spec``): D_p=2 -> D_t=3, swap off, each
    node pinned to its machines' cores (5 machines on this host's cores, round robin)."""
    spec = {
        "version": 1, "model_dir": str(model), "mode": "disaggregated",
        "prefill": {"pipelines": 1, "depth": 2}, "decode": {"pipelines": 1, "depth": 3},
        "machines": 5, "batch": 2, "prompt_len": 8, "new_tokens": 8, "planner": {},
    }
    cores = sorted(os.sched_getaffinity(0))
    spec["devices"] = spread_devices(spec, [Devices("cpu", (cores[i % len(cores)],))
                                            for i in range(5)])
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_dir = str(tmp_path / "cluster")
    argv = ["--spec", str(tmp_path / "spec.json"), "--dir", run_dir,
            "--max-seq-len", str(MAX_SEQ_LEN), "--swap", "off"]
    code, out = _cli(up_main, argv)
    try:
        assert code == 0, out
        code, out = _cli(status_main, ["--json", "--dir", run_dir])
        assert code == 0, out
        state = json.loads(out)
        placed = sorted((n["role"], n["pipeline"], n["stage"], n["depth"])
                        for n in state["nodes"] if n["role"] != "frontend")
        assert placed == [("decode", 0, 0, 3), ("decode", 0, 1, 3), ("decode", 0, 2, 3),
                          ("prefill", 0, None, 2)]
        assert run_all(state["frontend"]["grpc"]) == expected
        for node in state["nodes"]:  # the tritonserver, its stubs, all their threads
            want = (Devices.parse(node["devices"]).ids if node["role"] != "frontend"
                    else os.sched_getaffinity(0))
            assert node["devices"] == spec["devices"].get(node["name"])
            assert _allowed_cores(node["pid"]) == {frozenset(want)}, node["name"]
            assert len(_descendants(node["pid"])) > 1  # the Python-backend stubs are there
        code, out = _cli(status_main, ["--dir", run_dir])
        line = next(line for line in out.splitlines() if line.startswith("decode0s1 "))
        assert f" {spec['devices']['decode0s1']} " in line
    finally:
        code, out = _cli(down_main, ["--dir", run_dir])
    assert code == 0, out
