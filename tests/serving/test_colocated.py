"""Colocated mode (the baseline): one T-node prefills and decodes, no KV handoff."""

from __future__ import annotations

import pytest
from cluster_helpers import PROMPTS, cluster_up, ids_of, reference, run_concurrently

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def test_colocated_matches_reference(model, tmp_path):
    expected = reference(model, PROMPTS, MAX_TOKENS)
    with cluster_up(model, tmp_path, colocated=True) as cluster:
        assert not cluster.role("prefill")
        urls = {"grpc": cluster.frontend.grpc_url, "http": cluster.frontend.http_url}
        for protocol, url in urls.items():
            results = run_concurrently(protocol, url, PROMPTS, max_tokens=MAX_TOKENS)
            assert [ids_of(chunks) for chunks in results] == expected
