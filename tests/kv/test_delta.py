"""Token-step deltas: packing a batch's step, and streaming it into receiver slots."""

from __future__ import annotations

import pytest
import torch

from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.delta import DeltaStreamer, gather_step, scatter_step
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.layout import KVCache, KVLayout
from orchestrator.kv.transport.local import LocalFabric, LocalTransport

SECRET = b"s3cret"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, max_seq_len=12, first_layer=3)


def test_gather_then_scatter_moves_exactly_one_position() -> None:
    caches = [KVCache(LAYOUT, torch.randn(LAYOUT.shape)) for _ in range(3)]
    positions = [0, 5, 11]
    staging = torch.empty(3 * LAYOUT.step_bytes(), dtype=torch.uint8)
    packed = gather_step(caches, positions, staging)
    assert packed.shape == (3, 3, 2, 2, 4)
    targets = [KVCache(LAYOUT, torch.zeros(LAYOUT.shape)) for _ in range(3)]
    scatter_step(packed, targets, positions)
    for src, dst, pos in zip(caches, targets, positions, strict=True):
        assert torch.equal(dst.data[:, :, :, pos], src.data[:, :, :, pos])
        dst.data[:, :, :, pos] = 0
        assert dst.data.abs().sum() == 0


def stream_setup(checksum: bool):
    fabric = LocalFabric()
    receiver = KVReceiver(LocalTransport(fabric, "replica"), LAYOUT, 2, SECRET, 0.5, checksum)
    source = LocalTransport(fabric, "stage")
    sender = KVSender(source, LAYOUT, SECRET)
    streamer = DeltaStreamer(source, LAYOUT, SECRET, max_batch=2, depth=2, checksum=checksum)
    return receiver, sender, streamer


@pytest.mark.parametrize("checksum", [False, True])
def test_deltas_stream_into_reserved_slots_in_the_background(checksum: bool) -> None:
    receiver, sender, streamer = stream_setup(checksum)
    caches = [KVCache(LAYOUT, torch.randn(LAYOUT.shape), n) for n in (4, 6)]
    rids = ["a", "b"]
    for rid, cache in zip(rids, caches, strict=True):  # the prompt part first
        ticket = receiver.reserve(rid, cache.length)
        handle = sender.start(rid, [ticket])
        for layer in range(3, 6):
            sender.save_layer(handle, layer, cache)
        sender.finish(handle)
        sender.wait_for_save(handle, 1)
        receiver.wait(rid)
        streamer.add_target(rid, ticket)
    for _ in range(5):  # five decode steps of the batch
        positions = [c.length for c in caches]
        streamer.submit(rids, caches, positions)
        for cache in caches:
            cache.length += 1
    streamer.flush(timeout_s=1)
    for rid, cache in zip(rids, caches, strict=True):
        replica = receiver.cache(rid)
        assert replica.length == cache.length
        n = cache.length
        assert torch.equal(replica.data[:, :, :, :n], cache.data[:, :, :, :n])
        assert replica.data[:, :, :, n:].abs().sum() == 0
    assert streamer.bytes_sent == 5 * 2 * LAYOUT.step_bytes()
    streamer.close()


def test_a_skipped_step_fails_the_replica() -> None:
    receiver, sender, streamer = stream_setup(False)
    cache = KVCache(LAYOUT, torch.randn(LAYOUT.shape), 4)
    ticket = receiver.reserve("a", 4)
    handle = sender.start("a", [ticket])
    for layer in range(3, 6):
        sender.save_layer(handle, layer, cache)
    sender.finish(handle)
    receiver.wait("a")
    streamer.add_target("a", ticket)
    streamer.submit(["a"], [cache], [5])  # position 4 never sent
    streamer.flush(timeout_s=1)
    with pytest.raises(
        KVTransferError, match="delta for position 5 of a SUCCESS request holding 4"
    ):
        receiver.wait("a")
    streamer.close()


def test_streamer_rejects_a_mismatched_target_and_reports_a_dead_peer() -> None:
    receiver, _, streamer = stream_setup(False)
    other = KVReceiver(
        LocalTransport(receiver.transport.fabric, "other"), LAYOUT.layers(3, 2), 1, SECRET
    )
    with pytest.raises(KVTransferError, match="num_layers mismatch: 2 vs 3"):
        streamer.add_target("x", other.reserve("x", 2))
    streamer.add_target("a", receiver.reserve("a", 2))
    receiver.transport.close()
    streamer.submit(["a"], [KVCache(LAYOUT, torch.randn(LAYOUT.shape))], [2])
    with pytest.raises(KVTransferError, match="peer 'replica'"):
        streamer.flush(timeout_s=1)
    streamer.close()
