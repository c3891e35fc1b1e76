"""A P-node's prefix-cache hit streams the cached positions of every layer at once, ahead of
the suffix's compute, then each layer's computed positions as that layer finishes; a prompt
with no hit streams each whole layer as it computes, as before. Real torch engine, the KV
library over the in-process transport, two token stages (layers routed to their holder)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages
from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.prefix_cache import PrefixCache
from orchestrator.kv.transport.base import Pair, TransferHandle
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.kv.wire import decode_header
from orchestrator.layout import StageSpec
from orchestrator.pipeline.prefill import PrefillCancelled, decode_first_token, stream_prefill
from orchestrator.pipeline.prefix import PrefixReuse

SECRET = b"ahead"
MAX_SEQ = 64
BLOCK = 4
FIRST = [(7 * i + 3) % 400 + 4 for i in range(10)]  # 10 tokens: two whole blocks
LONGER = FIRST + [9, 8, 7, 6, 5, 4, 3]  # its first 8 positions cached after FIRST


class Recorder(LocalTransport):
    """Notes each write's layers and positions (from its checked header) in a shared log."""

    def __init__(self, fabric: LocalFabric, name: str, events: list) -> None:
        super().__init__(fabric, name)
        self.events = events

    fail_ahead = False  # a write of the cached part (its positions from 0) raises

    def write(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        header = decode_header(notify, SECRET, self.name)
        if self.fail_ahead and header.num_layers > 1:
            raise ConnectionError(f"{peer} went away")
        self.events.append(("write", peer, list(header.layer_range), header.positions))
        return super().write(peer, pairs, notify)


class Computing:
    """An engine whose prefill notes in the log when it starts computing."""

    def __init__(self, engine, events: list) -> None:
        self.engine, self.events = engine, events

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def prefill(self, inputs, caches, on_layer=None):
        self.events.append(("compute",))
        return self.engine.prefill(inputs, caches, on_layer=on_layer)


class Node:
    """One P-node (one prompt stage, a prefix cache) and two token stages."""

    def __init__(self, model) -> None:
        engine = load_stages(model, 1, max_seq_len=MAX_SEQ)[0]
        self.layout = engine.kv_layout
        self.events: list = []
        fabric = LocalFabric()
        self.engine = Computing(engine, self.events)
        self.sender = KVSender(Recorder(fabric, "p", self.events), self.layout, SECRET)
        self.stages = [range(s.first_layer, s.last_layer)
                       for s in StageSpec.split(self.layout.num_layers, 2)]
        self.receivers = [KVReceiver(LocalTransport(fabric, f"t{i}"),
                                     self.layout.layers(r.start, len(r)), 2, SECRET,
                                     timeout_s=5, checksum=True)
                          for i, r in enumerate(self.stages)]
        self.prefix = PrefixReuse(PrefixCache(self.layout, BLOCK, capacity_blocks=32))

    def prefill(self, rid: str, prompt: list[int], stop=None) -> dict[str, dict[str, int]]:
        """Stream ``prompt``; returns what stream_prefill counted (first, cached, sent, ahead)."""
        del self.events[:]
        tickets = [r.reserve(rid, len(prompt)) for r in self.receivers]
        counts: dict[str, dict[str, int]] = {"cached": {}, "sent": {}, "ahead": {}}
        counts["first"] = stream_prefill([self.engine], [self.sender], {rid: prompt},
                                         {rid: tickets}, stop=stop, prefix=self.prefix,
                                         **counts)
        return counts


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gpt2")


def whole_kv(model, prompt: list[int]) -> torch.Tensor:
    """The prompt's KV computed from its first token (no cache)."""
    engine = load_stages(model, 1, max_seq_len=MAX_SEQ)[0]
    cache = engine.new_cache()
    engine.prefill([torch.tensor(prompt)], [cache])
    return cache.data[:, :, :, : len(prompt)]


def test_a_hit_sends_every_layers_cached_part_before_the_compute_then_each_layers_rest(model):
    node = Node(model)
    row = node.layout.token_bytes_per_layer()
    layers = node.layout.num_layers
    first = node.prefill("first", FIRST)
    # no hit: each layer whole, after the compute began (the path before this change)
    assert first["cached"] == {"first": 0} and first["ahead"] == {"first": 0}
    assert node.events == [("compute",)] + [
        ("write", f"t{i}", [layer], range(0, len(FIRST)))
        for i, stage in enumerate(node.stages) for layer in stage]
    assert first["sent"] == {"first": len(FIRST) * layers * row}

    got = node.prefill("longer", LONGER)
    assert got["cached"] == {"longer": 8}
    # every token stage's layers, positions [0, 8), in one write each (posted while the
    # rest computes), before any computed layer; then each layer's computed positions
    writes = [e for e in node.events if e[0] == "write"]
    assert writes == [("write", f"t{i}", list(stage), range(0, 8))
                      for i, stage in enumerate(node.stages)] + [
        ("write", f"t{i}", [layer], range(8, len(LONGER)))
        for i, stage in enumerate(node.stages) for layer in stage]
    assert node.events.index(("compute",)) < node.events.index(writes[len(node.stages)])
    assert got["ahead"] == {"longer": 8 * layers * row}
    assert got["sent"] == {"longer": len(LONGER) * layers * row}  # no byte more than a miss
    assert got["first"]["longer"] == generate([node.engine.engine], [LONGER], 1)[0][0]
    want = whole_kv(model, LONGER)
    for receiver, stage in zip(node.receivers, node.stages, strict=True):
        cache, extra = receiver.wait("longer")
        assert decode_first_token(extra) == got["first"]["longer"]
        torch.testing.assert_close(cache.data[:, :, :, : len(LONGER)],
                                   want[stage.start : stage.stop])
    assert node.sender.in_flight() == 0 and node.prefix.cache.in_use() == {}


def test_a_hit_cancelled_after_its_first_layer_gives_everything_back(model):
    node = Node(model)
    node.prefill("first", FIRST)
    for receiver in node.receivers:
        receiver.wait("first")
        receiver.release("first")
    with pytest.raises(PrefillCancelled):
        node.prefill("longer", LONGER, stop=lambda: True)
    writes = [e for e in node.events if e[0] == "write"]
    assert len(writes) == len(node.stages) + 1  # what went ahead, and the first layer
    assert node.sender.in_flight() == 0 and node.prefix.cache.in_use() == {}
    for receiver in node.receivers:  # its slot is free at once: no writer is left
        receiver.progress()
        receiver.release("longer")
        receiver.reserve("a", 4), receiver.reserve("b", 4)  # both slots


def test_a_hit_whose_cached_part_fails_to_post_fails_and_gives_everything_back(model):
    """Posting the cached part raises (in its own thread): the prefill raises it before any
    computed layer is written, and gives back its staging and its cached blocks."""
    node = Node(model)
    node.prefill("first", FIRST)
    for receiver in node.receivers:
        receiver.wait("first")
        receiver.release("first")
    node.sender.transport.fail_ahead = True
    with pytest.raises(ConnectionError, match="went away"):
        node.prefill("longer", LONGER)
    assert [e for e in node.events if e[0] == "write"] == []
    assert node.sender.in_flight() == 0 and node.prefix.cache.in_use() == {}
