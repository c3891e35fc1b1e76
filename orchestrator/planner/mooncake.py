"""The Mooncake FAST'25 conversation trace: arrivals, prompts made from block hashes, and the
offline ideal prefix-cache hit rate at a given capacity.

Each request lists the ids of its prompt's 512-token blocks (``hash_ids``): equal ids at
the same positions are the same prefix. A replay makes each block's tokens from its id
(:func:`prompt_tokens`: the same id, the same tokens), so prompts share real tokens
exactly where the trace says, and a node's prefix cache hits them as it would.

The ideal (:func:`ideal_hit_rate`): one cache of the cluster's whole capacity, evicting
by Belady's rule (the block used again farthest in the future: the optimal offline
policy), every prompt sent where its blocks are: no router and no LRU does better at
that capacity. :func:`lru_hit_rate` is the same single cache under LRU, and
:func:`routed_hit_rate` that capacity split into the nodes' own LRU caches behind the KV
router (its cost, and each node's queue timed by the profile): where the ideal's hits go.
"""

from __future__ import annotations

import gzip
import heapq
import json
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
SHIPPED = Path(__file__).parent / "traces" / "mooncake_conversation_20min.jsonl.gz"
FIRST_TOKEN = 3  # below: the dummy tokenizer's special tokens


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path | None = None, start_s: float = 0.0,
                  window_s: float = math.inf, rate_scale: float = 1.0) -> list[TraceRequest]:
    """The requests arriving in ``[start_s, start_s + window_s)`` of the trace (default: the
    shipped first 20 minutes; ``.gz`` or plain JSON lines), arrivals from 0 and
    ``rate_scale`` times as dense (2: twice the rate)."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    path = Path(path or SHIPPED)
    opener = gzip.open if path.suffix == ".gz" else open
    requests = []
    with opener(path, "rt") as lines:
        for line in lines:
            row = json.loads(line)
            at = row["timestamp"] / 1e3
            if start_s <= at < start_s + window_s:
                requests.append(TraceRequest((at - start_s) / rate_scale, row["input_length"],
                                             row["output_length"], tuple(row["hash_ids"])))
    if not requests:
        raise ValueError(f"no request of {path} arrives in [{start_s}, {start_s + window_s}) s")
    return requests


class BlockTokens:
    """The tokens of each trace block, made from its id (cached: prompts share blocks)."""

    def __init__(self, vocab_size: int, block: int = TRACE_BLOCK_TOKENS) -> None:
        if vocab_size <= FIRST_TOKEN:
            raise ValueError(f"a vocabulary of {vocab_size} has no ordinary tokens")
        self.vocab_size, self.block = vocab_size, block
        self._made: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        tokens = self._made.get(hash_id)
        if tokens is None:
            import numpy as np

            rng = np.random.default_rng(hash_id)
            tokens = rng.integers(FIRST_TOKEN, self.vocab_size, self.block).tolist()
            self._made[hash_id] = tokens
        return tokens


def prompt_tokens(request: TraceRequest, blocks: BlockTokens, max_prompt: int) -> list[int]:
    """The request's prompt: its blocks' tokens, cut at its length (at most ``max_prompt``)."""
    n = min(request.prompt_len, max_prompt)
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        if len(tokens) >= n:
            break
        tokens += blocks(hash_id)
    return tokens[:n]


def _refs(prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    return [tuple(p) for p in prompts]


def ideal_hit_rate(prompts: Sequence[Sequence[int]], lengths: Sequence[int],
                   capacity_blocks: int, block_tokens: int) -> float:
    """Prompt tokens found cached over all prompt tokens: each prompt's block hashes
    (``prompts[i]``, of a prompt of ``lengths[i]`` tokens) in order through one cache of
    ``capacity_blocks`` blocks under Belady's eviction. A prompt hits its leading cached
    blocks, one token at least left to compute, and then holds all its blocks."""
    refs = _refs(prompts)
    next_use: list[list[float]] = [[math.inf] * len(r) for r in refs]
    seen: dict[int, int] = {}  # hash -> the index of the next request using it
    for i in range(len(refs) - 1, -1, -1):
        for j, h in enumerate(refs[i]):
            next_use[i][j] = seen.get(h, math.inf)
        for h in refs[i]:
            seen[h] = i
    cached: dict[int, float] = {}  # hash -> its next use
    # (-next use, -position in its prefix, hash): the farthest first and, among blocks next
    # used together, a prefix's last one first (a hit needs every block from the first)
    farthest: list[tuple[float, int, int]] = []
    hit = 0
    for i, (hashes, length) in enumerate(zip(refs, lengths, strict=True)):
        hit += _cached_prefix(hashes, length, block_tokens, cached) * block_tokens
        for j, (h, nxt) in enumerate(zip(hashes, next_use[i], strict=True)):
            if h not in cached:
                if math.isinf(nxt):
                    continue  # never used again: keeping it gains nothing
                if not _make_room(cached, farthest, capacity_blocks, (-nxt, -j)):
                    continue
            cached[h] = nxt
            heapq.heappush(farthest, (-nxt, -j, h))
    return hit / sum(lengths)


def _make_room(cached: dict[int, float], farthest: list[tuple[float, int, int]],
               capacity: int, newcomer: tuple[float, int]) -> bool:
    """Evict, Belady's way, until a block fits; False (nothing evicted) if every block
    held is needed no later than the newcomer."""
    while len(cached) >= capacity:
        far, depth, victim = heapq.heappop(farthest)
        if cached.get(victim) != -far:
            continue  # a stale entry: the block was used again since
        if (far, depth) >= newcomer:
            heapq.heappush(farthest, (far, depth, victim))
            return False
        del cached[victim]
    return True


def lru_hit_rate(prompts: Sequence[Sequence[int]], lengths: Sequence[int],
                 capacity_blocks: int, block_tokens: int) -> float:
    """:func:`ideal_hit_rate` with LRU eviction instead (the cache's own policy, one cache)."""
    cached: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for hashes, length in zip(_refs(prompts), lengths, strict=True):
        hit += _cached_prefix(hashes, length, block_tokens, cached) * block_tokens
        for h in reversed(hashes):  # the prefix's first blocks most recent, as the cache
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > capacity_blocks:
            cached.popitem(last=False)
    return hit / sum(lengths)


def routed_hit_rate(arrivals: Sequence[float], prompts: Sequence[Sequence[int]],
                    lengths: Sequence[int], nodes: int, capacity_blocks: int, block_tokens: int,
                    prefill_s: Callable[[int, int], float], kv_weight: float) -> float:
    """:func:`lru_hit_rate` of ``nodes`` caches of ``capacity_blocks`` each, a prompt going
    to the node of lowest ``kv_weight * (tokens to compute there) + its pending tokens``
    (the frontend's KV router); a node prefills its prompts in turn, each taking
    ``prefill_s(new tokens, cached tokens)``, and its pending tokens are those of the
    prompts it has not finished."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
    queues: list[deque[tuple[float, int]]] = [deque() for _ in range(nodes)]  # (end, tokens)
    free_at, pending = [0.0] * nodes, [0] * nodes
    hit = 0
    for now, hashes, length in zip(arrivals, _refs(prompts), lengths, strict=True):
        for node, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                pending[node] -= queue.popleft()[1]
        work = [length - _cached_prefix(hashes, length, block_tokens, c) * block_tokens
                for c in caches]
        node = min(range(nodes), key=lambda n: (kv_weight * work[n] + pending[n], pending[n]))
        cached = length - work[node]
        hit += cached
        free_at[node] = max(now, free_at[node]) + prefill_s(work[node], cached)
        queues[node].append((free_at[node], work[node]))
        pending[node] += work[node]
        cache = caches[node]
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / sum(lengths)


def _cached_prefix(hashes: list[int], length: int, block_tokens: int,
                   cached: Container[int]) -> int:
    """The leading blocks of a ``length``-token prompt that ``cached`` holds (its last token
    is always computed: its logits give the first token)."""
    found = 0
    for h in hashes[: (length - 1) // block_tokens]:
        if h not in cached:
            break
        found += 1
    return found
