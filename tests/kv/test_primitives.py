"""DejaVuLib's KV movement over the in-process transport."""

from __future__ import annotations

import pytest
import torch

from orchestrator.kv.primitives import (
    Route,
    kv_spans,
    pack,
    pair_spans,
    region_view,
    routes,
    scatter,
    stream_out,
)
from orchestrator.kv.transport.base import KVPoll, Region, tensor_region
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.layout import KVCache, KVLayout, StageSpec

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, max_seq_len=8, first_layer=2)


def stages(num_layers: int, depth: int) -> list[range]:
    return [range(s.first_layer, s.last_layer) for s in StageSpec.split(num_layers, depth)]


def random_cache(layout: KVLayout = LAYOUT) -> KVCache:
    return KVCache(layout, torch.randn(layout.shape), 0)


@pytest.fixture
def pair():
    fabric = LocalFabric()
    a, b = LocalTransport(fabric, "a"), LocalTransport(fabric, "b")
    a.add_peer("b", b.metadata())
    b.add_peer("a", a.metadata())
    return a, b


def test_write_and_read_contiguous_blocks(pair) -> None:
    a, b = pair
    src, dst, back = torch.randn(64), torch.zeros(64), torch.zeros(16)
    a.register(src), b.register(dst), a.register(back)
    handle = a.write("b", [(tensor_region(src), tensor_region(dst))], b"done")
    assert a.poll(handle) == KVPoll.SUCCESS
    assert torch.equal(src, dst)
    assert b.drain_notifications() == [("a", b"done")]
    handle = a.read("b", [(tensor_region(back), tensor_region(dst).sub(16, 64))])
    assert a.poll(handle) == KVPoll.SUCCESS and torch.equal(back, src[4:20])


def test_spans_follow_pack_order() -> None:
    cache = random_cache()
    layers, positions = range(3, 5), range(2, 7)
    staging = torch.zeros(LAYOUT.slot_bytes(), dtype=torch.uint8)
    packed = pack(cache, layers, positions, staging).reshape(-1)
    spans = kv_spans(LAYOUT, cache.data.data_ptr(), layers, positions)
    assert len(spans) == 2 * 2 * 2 and all(s.nbytes == 5 * 4 * 4 for s in spans)
    flat = cache.data.reshape(-1)
    pieces = [flat[(s.addr - cache.data.data_ptr()) // 4 :][: s.nbytes // 4] for s in spans]
    assert torch.equal(torch.cat(pieces), packed)
    other = KVCache(LAYOUT, torch.zeros(LAYOUT.shape))
    view = region_view(other, layers, positions)
    view.copy_(staging.view(view.dtype)[: view.numel()].view(view.shape))
    assert torch.equal(other.data[1:3, :, :, 2:7], cache.data[1:3, :, :, 2:7])
    assert other.data[0].abs().sum() == 0 and other.data[:, :, :, 7].abs().sum() == 0


def test_spans_reject_bad_ranges() -> None:
    with pytest.raises(ValueError, match="positions"):
        kv_spans(LAYOUT, 0, range(2, 3), range(5, 9))
    with pytest.raises(ValueError, match="outside"):
        kv_spans(LAYOUT, 0, range(1, 3), range(0, 1))


def test_pair_spans_cuts_at_both_sides_boundaries() -> None:
    pairs = pair_spans([Region(0, 10), Region(100, 6)], [Region(50, 4), Region(70, 12)])
    assert pairs == [
        (Region(0, 4), Region(50, 4)),
        (Region(4, 6), Region(70, 6)),
        (Region(100, 6), Region(76, 6)),
    ]
    with pytest.raises(ValueError, match="total size"):
        pair_spans([Region(0, 4)], [Region(0, 5)])


def test_scatter_and_read_back_a_kv_region(pair) -> None:
    a, b = pair
    source, remote = random_cache(), KVCache(LAYOUT, torch.zeros(LAYOUT.shape))
    staging = torch.zeros(LAYOUT.slot_bytes(), dtype=torch.uint8)
    a.register(staging), b.register(remote.data)
    layers, positions = range(2, 5), range(0, 6)
    packed = pack(source, layers, positions, staging)
    nbytes = packed.numel() * 4
    spans = kv_spans(LAYOUT, remote.data.data_ptr(), layers, positions)
    local = tensor_region(staging).sub(0, nbytes)
    assert a.poll(scatter(a, "b", [local], spans)) == KVPoll.SUCCESS
    assert torch.equal(remote.data[:, :, :, :6], source.data[:, :, :, :6])
    assert remote.data[:, :, :, 6:].abs().sum() == 0
    staging.zero_()
    assert a.poll(a.read("b", pair_spans([local], spans))) == KVPoll.SUCCESS
    assert torch.equal(packed, source.data[:, :, :, :6])


def test_unregistered_memory_and_departed_peers_fail_the_transfer(pair) -> None:
    a, b = pair
    src, dst = torch.randn(8), torch.zeros(8)
    a.register(src)
    handle = a.write("b", [(tensor_region(src), tensor_region(dst))])
    assert a.poll(handle) == KVPoll.FAILED and "not registered on peer 'b'" in handle.error
    b.register(dst)
    b.close()
    handle = a.write("b", [(tensor_region(src), tensor_region(dst))])
    assert a.poll(handle) == KVPoll.FAILED and "'b'" in handle.error


def test_routes_one_prompt_stage_to_two_token_stages() -> None:
    prompt, token = stages(12, 1), stages(12, 2)
    assert stream_out(prompt[0], token) == [Route(0, 0, range(0, 6)), Route(0, 1, range(6, 12))]
    assert [r for r in routes(prompt, token) if r.dst == 1] == [Route(0, 1, range(6, 12))]


def test_routes_two_prompt_stages_to_three_token_stages() -> None:
    prompt, token = stages(12, 2), stages(12, 3)
    # prompt stages [0,6) [6,12); token stages [0,4) [4,8) [8,12)
    assert stream_out(prompt[0], token) == [Route(0, 0, range(0, 4)), Route(0, 1, range(4, 6))]
    by_src = [r for r in routes(prompt, token) if r.src == 1]
    assert by_src == [Route(1, 1, range(6, 8)), Route(1, 2, range(8, 12))]
    by_dst = [r for r in routes(prompt, token) if r.dst == 1]
    assert by_dst == [Route(0, 1, range(4, 6)), Route(1, 1, range(6, 8))]


@pytest.mark.parametrize(("depth_p", "depth_t"), [(1, 1), (1, 3), (3, 1), (2, 3), (3, 2), (4, 7)])
def test_routes_cover_every_layer_once(depth_p: int, depth_t: int) -> None:
    prompt, token = stages(7, depth_p), stages(7, depth_t)
    covered = [layer for p in prompt for r in stream_out(p, token) for layer in r.layers]
    assert sorted(covered) == list(range(7))
    assert routes([range(0, 3)], [range(5, 9)]) == []
