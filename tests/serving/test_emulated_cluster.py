"""An emulated cluster: real tritonservers, orchestrator, NIXL KV and replication, with the
engine's compute replaced by a GPU profile's step times. It serves token-exactly."""

from __future__ import annotations

import pytest
from cluster_helpers import PROMPTS, cluster_up, ids_of, run_concurrently

from orchestrator.engine.config import ModelConfig
from orchestrator.engine.emulated import emulated_reference
from orchestrator.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROFILE = "splitwise-llama2-70b-h100"


@pytest.mark.parametrize(("colocated", "prefill"), [(False, 1), (True, 0)],
                         ids=["disaggregated", "colocated"])
def test_emulated_cluster_serves_token_exactly(model, tmp_path, colocated, prefill):
    tokenizer = load_tokenizer(model)
    vocab = ModelConfig.from_dir(model).vocab_size
    expected = [emulated_reference(tokenizer.encode(p).ids, MAX_TOKENS, vocab) for p in PROMPTS]
    with cluster_up(model, tmp_path, prefill=prefill, decode=1, decode_depth=2,
                    colocated=colocated, profile=PROFILE, openai=False) as cluster:
        got = run_concurrently("grpc", cluster.frontend.grpc_url, PROMPTS,
                               max_tokens=MAX_TOKENS)
    assert [ids_of(chunks) for chunks in got] == expected
