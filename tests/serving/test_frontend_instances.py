"""The token path scaled out: several ``orchestrator`` instances in the frontend's
tritonserver (``frontend_instances``), each its own process, Frontend and token feeds,
with Triton spreading the ensemble's requests across them, and ``stream_interval``
tokens per streamed response. Real tritonservers, the emulated engine (no GPU time to
wait for: its tokens are a hash of the sequence)."""

from __future__ import annotations

import pytest
from cluster_helpers import ALL_PROMPTS, cluster_up, ids_of, metric, module_cluster

from clients.generate import stream_grpc
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.emulated import emulated_reference
from orchestrator.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
MAX_TOKENS, INTERVAL, INSTANCES = 14, 4, 2
PROMPTS = ALL_PROMPTS * 2  # 16 streams at once

cluster = module_cluster("instances", cluster_up, prefill=1, decode=1,
                         profile="splitwise-llama2-70b-h100", frontend_instances=INSTANCES,
                         stream_interval=INTERVAL)


def test_every_instance_serves_and_the_tokens_are_the_references(model, cluster):
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = load_tokenizer(model)
    vocab = ModelConfig.from_dir(model).vocab_size
    url = cluster.frontend.grpc_url
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: list(stream_grpc(url, p, max_tokens=MAX_TOKENS,
                                                       end_id=-1)), PROMPTS))
    assert [ids_of(chunks) for chunks in got] == [
        emulated_reference(tokenizer.encode(p).ids, MAX_TOKENS, vocab) for p in PROMPTS]
    # The first token alone, then INTERVAL per response, the rest in the last.
    sizes = [len(chunk.ids) for chunk in got[0] if chunk.ids]
    assert sizes[0] == 1 and all(n >= INTERVAL for n in sizes[1:-1]) and sum(sizes) == MAX_TOKENS
    served = [metric(cluster.frontend, "dejavu_requests", outcome="finished",
                     instance=f"orchestrator_0_{i}") for i in range(INSTANCES)]
    assert sum(served) == len(PROMPTS) and all(served), served


def test_an_openai_stream_takes_several_tokens_per_event(model, cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.openai.url, api_key="unused", max_retries=0)
    whole = client.completions.create(model=model.name, prompt=PROMPTS[0],
                                      max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model.name, prompt=PROMPTS[0],
                                            max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    # The first token, then INTERVAL per event, and the last (empty) event with its reason:
    # not one event per token.
    assert len(texts) <= 2 + -(-(MAX_TOKENS - 1) // INTERVAL) < MAX_TOKENS
