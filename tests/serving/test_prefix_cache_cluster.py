"""KV reuse on real tritonservers: the prefix cache of the node that prefills (a P-node of
1P+1T, a colocated T-node, one with chunked prefill, a colocated pipeline of two T-nodes:
its head's index, each stage's layers) over a multi-turn conversation; and
decode-side reuse (1P+1T's T-node keeps each finished turn's KV, and is streamed only the
blocks it lacks). Disaggregated, a P-node's hit streams its cached positions of every layer
ahead of the rest's compute (those the T-node lacks: none where it kept the last turn).

Each turn's prompt is the last one, its answer and a new message: the node loads the
cached blocks, prefills only the rest, and the greedy tokens are the single-process
reference's (the cache off). ``cached_tokens`` says exactly the blocks reused; a request
under another ``cache_salt`` never hits the blocks of the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import MAX_SEQ_LEN, cluster_up, eventually, metric
from test_trtllm_clients import stream

from orchestrator.engine.reference import generate
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.engine.torch_engine import load_engine

pytestmark = pytest.mark.slow
BLOCK = 16
MAX_TOKENS = 6
FIRST = [(7 * i + 3) % 500 + 1 for i in range(40)]
MESSAGES = [[(11 * i + 5) % 500 + 1 for i in range(n)] for n in (21, 9, 30)]



# disaggregated: the T-node keeps finished turns too (decode-side reuse); p-cache-only: it
# does not, so each hit's cached positions stream to it ahead of the rest's compute.
# colocated-chunked: 8-token steps (4 token steps at most in them): each prompt takes
# several chunks, its first after the blocks cached. colocated-depth-2: 48-token steps, so
# most prompts' uncached rest runs whole in one step and the longer ones in two.
LAYOUTS = {"disaggregated": {}, "disaggregated-p-cache-only": {"decode_cache_mb": 0},
           "colocated": {"colocated": True},
           "colocated-chunked": {"colocated": True, "max_batch": 4, "prefill_chunk": 8},
           "colocated-depth-2": {"colocated": True, "decode_depth": 2, "max_batch": 4,
                                 "prefill_chunk": 48}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with cluster_up(model, tmp_path_factory.mktemp(request.param), prefix_cache_mb=4,
                    kv_block=BLOCK, **{"decode_cache_mb": 4, **LAYOUTS[request.param]}) as up:
        yield up


def ask(url: str, prompt: list[int], salt: str = "") -> tuple[list[int], int]:
    """Greedy ids and ``cached_tokens`` of one request to the token model."""
    request = {"input_ids": np.array([prompt], np.int32),
               "input_lengths": np.array([[len(prompt)]], np.int32),
               "request_output_len": np.array([[MAX_TOKENS]], np.int32),
               "end_id": np.array([[-1]], np.int32),
               "streaming": np.array([[False]])}
    if salt:
        request["cache_salt"] = np.array([[salt.encode()]], np.object_)
    ids, cached = [], set()
    for result in stream(url, "tensorrt_llm", request):
        ids += result.as_numpy("output_ids").reshape(-1).tolist()
        cached.add(int(result.as_numpy("cached_tokens").reshape(-1)[0]))
    assert len(cached) == 1, cached
    return ids[len(prompt):], cached.pop()


def conversation(engine) -> list[tuple[list[int], list[int]]]:
    """(prompt, the reference's answer) per turn: each prompt extends the last turn's."""
    turns, prompt = [], FIRST
    for message in [*MESSAGES, None]:
        answer = generate([engine], [prompt], MAX_TOKENS)[0]
        turns.append((prompt, answer))
        if message is not None:
            prompt = prompt + answer + message
    return turns


def test_multi_turn_prompts_reuse_their_prefix_token_exact(cluster, model, request):
    """Disaggregated, ``dejavu_kv_ahead_bytes`` says the P-node sent each hit's cached
    positions ahead of the compute, exactly: all of them where the T-node keeps nothing,
    none where it kept the last turn's KV (it holds them already)."""
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
    t_node_keeps = LAYOUTS[request.node.callspec.params["cluster"]].get("decode_cache_mb", 4)
    p_node = cluster.role("prefill")[0].server if cluster.role("prefill") else None
    url = cluster.frontend.grpc_url
    previous: list[int] = []
    turns = conversation(engine)
    ahead = 0
    for prompt, answer in [*turns, turns[-1]]:  # the last, repeated
        before = metric(p_node, "dejavu_kv_ahead_bytes") if p_node else 0
        got, cached = ask(url, prompt)
        assert got == answer
        # every whole block the last prompt stored, one token at least left to compute
        assert cached == min(len(previous), len(prompt) - 1) // BLOCK * BLOCK
        if p_node is not None:
            want = 0 if t_node_keeps else cached * token_bytes
            assert eventually(lambda b=before: metric(p_node, "dejavu_kv_ahead_bytes") - b,
                              lambda v, w=want: v >= w) == want
            ahead += want
        previous = prompt
    assert p_node is None or t_node_keeps or ahead > 0

    node = (cluster.role("prefill") or cluster.role("decode"))[0].server  # the one prefilling
    hit = eventually(lambda: metric(node, "dejavu_prefix_cache", what="hit_tokens"),
                     lambda v: v > 0)
    looked = metric(node, "dejavu_prefix_cache", what="lookup_tokens")
    assert metric(node, "dejavu_prefix_cache", what="hit_rate") == pytest.approx(hit / looked)
    assert 0 < metric(node, "dejavu_prefix_cache", what="bytes") <= metric(
        node, "dejavu_prefix_cache", what="budget_bytes")


@pytest.mark.parametrize("cluster", ["disaggregated"], indirect=True)  # KV streamed P -> T
def test_a_t_node_keeps_each_finished_turn_and_is_streamed_only_the_blocks_it_lacks(
        cluster, model):
    """Decode-side reuse, token-exact: each turn's T-node slot starts with the whole blocks
    of the last turn's prompt and answer (its KV, kept when it finished), and the P-node
    streams only the rest: the T-node's ``dejavu_kv_reused_bytes`` and the P-node's
    ``dejavu_kv_bytes`` say exactly that many bytes."""
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
    p_node, t_node = cluster.role("prefill")[0].server, cluster.role("decode")[0].server
    first = [(23 * i + 4) % 500 + 1 for i in range(37)]  # a conversation only this test has
    turns, prompt = [], first
    for message in MESSAGES:
        answer = generate([engine], [prompt], MAX_TOKENS)[0]
        turns.append((prompt, answer))
        prompt = prompt + answer + message
    turns.append((prompt, generate([engine], [prompt], MAX_TOKENS)[0]))

    kept = 0  # positions the T-node holds of this conversation: the last turn's KV
    for prompt, answer in turns:
        held = min(kept, len(prompt) - 1) // BLOCK * BLOCK
        reused = metric(t_node, "dejavu_kv_reused_bytes")
        sent = metric(p_node, "dejavu_kv_bytes")
        cache_bytes = metric(t_node, "dejavu_prefix_cache", what="bytes")
        assert ask(cluster.frontend.grpc_url, prompt)[0] == answer
        assert eventually(lambda s=sent: metric(p_node, "dejavu_kv_bytes") - s,
                          lambda v: v > 0) == (len(prompt) - held) * token_bytes
        assert eventually(lambda r=reused: metric(t_node, "dejavu_kv_reused_bytes") - r,
                          lambda v, h=held: v >= h * token_bytes) == held * token_bytes
        # its KV (the answer's last token has none) is kept once the T-node frees it
        grown = ((len(prompt) + MAX_TOKENS - 1) // BLOCK - kept // BLOCK) * BLOCK * token_bytes
        eventually(lambda b=cache_bytes: metric(t_node, "dejavu_prefix_cache", what="bytes") - b,
                   lambda v, g=grown: v >= g)
        kept = len(prompt) + MAX_TOKENS - 1
    assert held > 0


def test_another_cache_salt_never_hits(cluster, model):
    url = cluster.frontend.grpc_url
    prompt = [(13 * i + 1) % 500 + 1 for i in range(50)]
    want = generate([load_engine(model, max_seq_len=MAX_SEQ_LEN)], [prompt], MAX_TOKENS)[0]
    assert ask(url, prompt, salt="tenant-a") == (want, 0)
    assert ask(url, prompt, salt="tenant-b") == (want, 0)
    assert ask(url, prompt) == (want, 0)  # no salt: the salted blocks are not its either
    assert ask(url, prompt, salt="tenant-a") == (want, 48)


def test_openai_reports_cached_tokens_and_takes_a_cache_salt(cluster, model):
    import openai

    client = openai.OpenAI(base_url=cluster.openai.url, api_key="unused", max_retries=0)
    prompt = " ".join(f"word{i}" for i in range(30))  # a prompt only this test sends
    n = len(load_tokenizer(model).encode(prompt).ids)
    assert n > BLOCK

    def cached(**extra) -> int:
        done = client.completions.create(model=model.name, prompt=prompt, max_tokens=3,
                                         temperature=0, extra_body=extra)
        assert done.usage.prompt_tokens == n
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="openai-tenant") == 0
    assert cached() == 0  # its blocks are the salt's
    assert cached(cache_salt="openai-tenant") == (n - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("layout", [{"prefill": 2}, {"prefill": 0, "decode": 2,
                                                    "colocated": True},
                                    {"prefill": 1, "decode": 2, "decode_cache_mb": 4}],
                         ids=["2P+1T", "2 colocated", "1P+2T decode-side"])
def test_the_kv_router_sends_each_next_turn_to_the_node_holding_its_prefix(model, tmp_path,
                                                                         layout):
    """2 prefilling nodes, KV-aware routing: four first turns at once (the router spreads
    them by queue), then their second turns at once: each finds its whole prefix cached,
    so the router indexed the nodes' signed KV events and sent each to the node holding
    it. Decode-side (2 T-nodes keeping finished turns): each second turn goes back to the
    T-node holding its first turn's KV, which is streamed only the rest."""
    from concurrent.futures import ThreadPoolExecutor

    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    firsts = [[(17 * i + 31 * c) % 500 + 1 for i in range(40)] for c in range(4)]
    answers = generate([engine], firsts, MAX_TOKENS)
    seconds = [p + a + MESSAGES[0] for p, a in zip(firsts, answers, strict=True)]
    want = generate([engine], seconds, MAX_TOKENS)
    with cluster_up(model, tmp_path, prefix_cache_mb=4, kv_block=BLOCK, router="kv",
                    kv_weight=10.0, **layout) as up, ThreadPoolExecutor(4) as pool:
        url = up.frontend.grpc_url
        assert list(pool.map(lambda p: ask(url, p), firsts)) == [(a, 0) for a in answers]
        got = list(pool.map(lambda p: ask(url, p), seconds))
        assert got == [(w, len(f) // BLOCK * BLOCK) for w, f in zip(want, firsts, strict=True)]
        nodes = up.role("prefill") or up.role("decode")
        eventually(lambda: sum(metric(n.server, "dejavu_prefix_cache", what="hit_tokens")
                               for n in nodes), lambda hits: hits == 4 * 32)
        if layout == {"prefill": 2}:  # each hit's 32 positions went to the T-node ahead
            token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
            eventually(lambda: sum(metric(n.server, "dejavu_kv_ahead_bytes") for n in nodes),
                       lambda ahead: ahead == 4 * 32 * token_bytes)
        if "decode_cache_mb" in layout:  # each T-node held the first turn's 2 whole blocks
            token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
            eventually(lambda: sum(metric(n.server, "dejavu_kv_reused_bytes")
                                   for n in up.role("decode")),
                       lambda reused: reused == 4 * 32 * token_bytes)


def test_a_replay_bigger_than_the_cache_stays_in_its_budget_and_keeps_serving(model, tmp_path):
    """A cache of 4 blocks (the tiny Llama's KV: 1 KiB a token) under 6 prompts of 2 blocks
    each: blocks are evicted, the cache never holds more than its budget, the tokens stay
    the reference's, and the latest prompt still hits."""
    engine = load_engine(model, max_seq_len=MAX_SEQ_LEN)
    prompts = [[(19 * i + 7 * c) % 500 + 1 for i in range(40)] for c in range(6)]
    want = generate([engine], prompts, MAX_TOKENS)
    budget = 4 * BLOCK * 1024
    with cluster_up(model, tmp_path, prefix_cache_mb=budget / 2**20, kv_block=BLOCK) as up:
        url, node = up.frontend.grpc_url, up.role("prefill")[0].server
        for prompt, answer in zip(prompts, want, strict=True):
            assert ask(url, prompt) == (answer, 0)
            assert metric(node, "dejavu_prefix_cache", what="bytes") <= budget
        assert ask(url, prompts[-1]) == (want[-1], 32)
        eventually(lambda: metric(node, "dejavu_prefix_cache", what="evicted_blocks"),
                   lambda evicted: evicted >= 6 * 2 - 4)
        assert metric(node, "dejavu_prefix_cache", what="budget_bytes") == budget
