"""Chunked prefill on colocated token pipelines (``--prefill-chunk``) on real tritonservers:
the same greedy tokens as whole prompts (the single-process reference) at depth 1 and 2,
and a stage killed (kill -9) while a long prompt is between two of its chunks: the
pipeline resumes that prompt from its replicas, with the same tokens."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import (
    FAULT_TOKENS,
    FIXED,
    PROMPTS,
    Streaming,
    assert_all_freed,
    cluster_up,
    fault_cluster,
    held,
    ids_concurrently,
    ids_of,
    reference,
)

from orchestrator.cluster import chaos
from orchestrator.cluster.launcher import read_state

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
# ~150 tokens of the tiny Llama's tokenizer: many chunks at a budget of a few tokens a step.
LONG_PROMPT = " ".join(PROMPTS * 2)
LONG_TOKENS = 40  # prompt + tokens within the tests' 256 positions


def test_chunked_prompts_at_depth_1_give_the_whole_prompts_tokens(model, tmp_path):
    prompts = [*PROMPTS, LONG_PROMPT]
    expected = reference(model, prompts, MAX_TOKENS)
    with cluster_up(model, tmp_path, colocated=True, max_batch=4, prefill_chunk=8) as cluster:
        assert ids_concurrently("grpc", cluster.frontend.grpc_url, prompts,
                                MAX_TOKENS) == expected


def test_chunked_depth_2_pipeline_resumes_a_prompt_killed_between_its_chunks(model, tmp_path):
    """Budget 5 with up to 4 token steps in it: the long prompt takes 1-5 tokens a step,
    dozens of steps. Stage 1 is killed once it holds the prompt's KV and before its first
    token: the recovery keeps the chunks its replicas hold and the prompt goes on."""
    expected = reference(model, [*PROMPTS[:4], LONG_PROMPT], FAULT_TOKENS, to_end=False)
    expected[-1] = expected[-1][:LONG_TOKENS]
    with fault_cluster(model, tmp_path, colocated=True, decode_depth=2, max_batch=5,
                       prefill_chunk=5) as cluster:
        url = cluster.frontend.grpc_url
        assert ids_concurrently("grpc", url, PROMPTS[:4], FAULT_TOKENS, **FIXED) == expected[:4]
        streams = [Streaming(url, p) for p in PROMPTS[:4]]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while not all(ids_of(s.chunks) for s in streams):
            assert time.monotonic() < deadline, "no tokens before the long prompt"
            time.sleep(0.02)
        long = Streaming(url, LONG_PROMPT, max_tokens=LONG_TOKENS)
        long.start()
        # Stage 1 holds KV of five sequences: the long prompt's first chunks are there.
        while held(cluster, "s1")["decode0s1"]["kv"] < 5:
            assert time.monotonic() < deadline, "the long prompt never reached stage 1"
            time.sleep(0.01)
        assert not long.chunks, "the long prompt was done before the kill (raise its length)"
        assert chaos.main(["kill", "decode0s1", "--dir", str(cluster.run_dir)]) == 0
        for s in [*streams, long]:
            s.join(150)
            assert not s.is_alive()
        assert [s.error for s in [*streams, long]] == [None] * 5
        assert [ids_of(s.chunks) for s in [*streams, long]] == expected
        assert [r["outcome"] for r in read_state(cluster.run_dir).get("repairs", [])] == [
            "resumed"]
        assert_all_freed(cluster)
