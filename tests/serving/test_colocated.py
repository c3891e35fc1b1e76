"""Colocated mode (the baseline): token pipelines prefill their own prompts, no KV handoff;
one T-node, and a depth-2 pipeline of two T-nodes (DejaVu's non-disaggregated baseline),
whose prompts run stage by stage in its microbatch steps."""

from __future__ import annotations

import pytest
from cluster_helpers import (
    FAULT_TOKENS,
    FIXED,
    PROMPTS,
    assert_all_freed,
    cluster_up,
    fault_cluster,
    ids_concurrently,
    ids_of,
    kill_mid_stream,
    reference,
)

from orchestrator.cluster.launcher import read_state

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def test_colocated_matches_reference(model, tmp_path):
    expected = reference(model, PROMPTS, MAX_TOKENS)
    with cluster_up(model, tmp_path, colocated=True) as cluster:
        assert not cluster.role("prefill")
        urls = {"grpc": cluster.frontend.grpc_url, "http": cluster.frontend.http_url}
        for protocol, url in urls.items():
            assert ids_concurrently(protocol, url, PROMPTS, MAX_TOKENS) == expected


def test_a_colocated_depth_2_pipeline_matches_reference_and_resumes_a_lost_stage(
        model, tmp_path):
    """Two T-nodes, prompts entering the pipeline across nodes; then stage 1 killed
    mid-stream: it comes back from the replicas on stage 0, the same tokens, no error."""
    expected = reference(model, PROMPTS, FAULT_TOKENS, to_end=False)
    with fault_cluster(model, tmp_path, colocated=True, decode_depth=2) as cluster:
        assert not cluster.role("prefill")
        url = cluster.frontend.grpc_url
        assert ids_concurrently("grpc", url, PROMPTS, FAULT_TOKENS, **FIXED) == expected
        requests = kill_mid_stream(cluster, PROMPTS[:4], ["decode0s1"])
        assert [r.error for r in requests] == [None] * 4
        assert [ids_of(r.chunks) for r in requests] == expected[:4]
        repairs = read_state(cluster.run_dir).get("repairs", [])
        assert [r["outcome"] for r in repairs] == ["resumed"]
        assert_all_freed(cluster)
