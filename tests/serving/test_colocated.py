"""Colocated mode (the baseline): one T-node prefills and decodes, no KV handoff."""

from __future__ import annotations

import pytest
from cluster_helpers import MAX_SEQ_LEN, PROMPTS, ids_of, reference, run_concurrently

from orchestrator.cluster.launcher import Cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def test_colocated_matches_reference(tiny_model, tmp_path):
    model = tiny_model("llama")
    expected = reference(model, PROMPTS, MAX_TOKENS)
    with Cluster.up(model, colocated=True, run_dir=tmp_path, max_seq_len=MAX_SEQ_LEN) as cluster:
        assert not cluster.role("prefill")
        urls = {"grpc": cluster.frontend.grpc_url, "http": cluster.frontend.http_url}
        for protocol, url in urls.items():
            results = run_concurrently(protocol, url, PROMPTS, max_tokens=MAX_TOKENS)
            assert [ids_of(chunks) for chunks in results] == expected
