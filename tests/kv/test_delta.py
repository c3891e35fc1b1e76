"""Token-step deltas: packing a batch's step, and streaming it into receiver slots."""

from __future__ import annotations

import time

import pytest
import torch

from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.delta import DeltaStreamer, gather_step
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.base import KVPoll, Pair, TransferHandle
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.layout import KVCache, KVLayout

SECRET = b"s3cret"
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, max_seq_len=12, first_layer=3)


def test_gather_then_scatter_moves_exactly_one_position() -> None:
    caches = [KVCache(LAYOUT, torch.randn(LAYOUT.shape)) for _ in range(3)]
    positions = [0, 5, 11]
    staging = torch.empty(3 * LAYOUT.step_bytes(), dtype=torch.uint8)
    packed = gather_step(caches, positions, staging)
    assert packed.shape == (3, 3, 2, 2, 4)
    targets = [KVCache(LAYOUT, torch.zeros(LAYOUT.shape)) for _ in range(3)]
    for i, (target, position) in enumerate(zip(targets, positions, strict=True)):
        target.data[:, :, :, position].copy_(packed[i])
    for src, dst, pos in zip(caches, targets, positions, strict=True):
        assert torch.equal(dst.data[:, :, :, pos], src.data[:, :, :, pos])
        dst.data[:, :, :, pos] = 0
        assert dst.data.abs().sum() == 0


def stream_setup(checksum: bool, landing_depth: int = 8, timeout_s: float = 1.0):
    fabric = LocalFabric()
    receiver = KVReceiver(
        LocalTransport(fabric, "replica"),
        LAYOUT,
        2,
        SECRET,
        0.5,
        checksum,
        delta_depth=landing_depth,
    )
    source = LocalTransport(fabric, "stage")
    sender = KVSender(source, LAYOUT, SECRET)
    streamer = DeltaStreamer(
        source, LAYOUT, SECRET, max_batch=2, depth=2, checksum=checksum, timeout_s=timeout_s
    )
    return receiver, sender, streamer


def send_prompt(receiver, sender, rid: str, cache: KVCache, finish: bool = True) -> bytes:
    ticket = receiver.reserve(rid, cache.length)
    handle = sender.start(rid, [ticket])
    for layer in LAYOUT.layer_range:
        sender.save_layer(handle, layer, cache)
    if finish:
        sender.finish(handle)
        sender.wait_for_save(handle, 1)
    return ticket, handle


@pytest.mark.parametrize("checksum", [False, True])
def test_deltas_stream_into_reserved_slots_in_the_background(
    checksum: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, sender, streamer = stream_setup(checksum)
    caches = [KVCache(LAYOUT, torch.randn(LAYOUT.shape), n) for n in (4, 6)]
    rids = ["a", "b"]
    for rid, cache in zip(rids, caches, strict=True):  # the prompt part first
        ticket, _ = send_prompt(receiver, sender, rid, cache)
        receiver.wait(rid)
        streamer.add_target(rid, ticket)
    sent: list[int] = []  # bytes of each transfer posted from here on: the streamer's
    write = streamer.transport.write

    def counting_write(peer: str, pairs: list[Pair], notify: bytes = b"") -> TransferHandle:
        sent.append(sum(local.nbytes for local, _ in pairs))
        return write(peer, pairs, notify)

    monkeypatch.setattr(streamer.transport, "write", counting_write)
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
    assert sum(sent) == 5 * 2 * LAYOUT.step_bytes()
    streamer.close()


def test_a_skipped_step_fails_the_replica() -> None:
    receiver, sender, streamer = stream_setup(False)
    cache = KVCache(LAYOUT, torch.randn(LAYOUT.shape), 4)
    ticket, _ = send_prompt(receiver, sender, "a", cache)
    receiver.wait("a")
    streamer.add_target("a", ticket)
    streamer.submit(["a"], [cache], [5])  # position 4 never sent
    streamer.flush(timeout_s=1)
    with pytest.raises(KVTransferError, match="delta for position 5, but the slot holds 4"):
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


def test_flow_control_waits_for_the_receiver_to_scatter() -> None:
    receiver, sender, streamer = stream_setup(False, landing_depth=2, timeout_s=0.3)
    cache = KVCache(LAYOUT, torch.randn(LAYOUT.shape), 4)
    ticket, _ = send_prompt(receiver, sender, "a", cache)
    streamer.add_target("a", ticket)
    # 5 steps into a 2-block landing ring, receiver idle: the streamer's thread gives up
    # waiting for room, and the next submit or the flush reports why.
    with pytest.raises(KVTransferError, match="it must call progress"):
        for position in range(4, 9):
            streamer.submit(["a"], [cache], [position])
        streamer.flush()
    assert receiver.cache("a").length == 6  # only what fit; nothing overwritten
    streamer.close()

    receiver, sender, streamer = stream_setup(False, landing_depth=2, timeout_s=5)
    ticket, _ = send_prompt(receiver, sender, "a", cache)
    streamer.add_target("a", ticket)
    for position in range(4, 12):
        streamer.submit(["a"], [cache], [position])
        receiver.progress()  # a replica holder progresses once per step
    deadline = time.monotonic() + 5
    while receiver.cache("a").length < 12 and time.monotonic() < deadline:
        time.sleep(0.001)
    streamer.flush()
    assert torch.equal(receiver.cache("a").data[:, :, :, :12], cache.data[:, :, :, :12])
    streamer.close()


def test_deltas_that_overtake_the_prompt_are_applied_after_it() -> None:
    receiver, sender, streamer = stream_setup(True)
    cache = KVCache(LAYOUT, torch.randn(LAYOUT.shape), 4)
    ticket, handle = send_prompt(receiver, sender, "a", cache, finish=False)
    streamer.add_target("a", ticket)
    streamer.submit(["a"], [cache], [4])
    streamer.flush()
    assert receiver.poll("a") == KVPoll.TRANSFERRING  # delta parked, prompt unfinished
    sender.finish(handle)
    replica, _ = receiver.wait("a")
    assert receiver.cache("a").length == 5
    assert torch.equal(receiver.cache("a").data[:, :, :, :5], cache.data[:, :, :, :5])
    streamer.close()


def test_a_corrupted_delta_is_caught_by_its_checksum() -> None:
    receiver, sender, streamer = stream_setup(True)
    cache = KVCache(LAYOUT, torch.randn(LAYOUT.shape), 4)
    ticket, _ = send_prompt(receiver, sender, "a", cache)
    receiver.wait("a")
    streamer.add_target("a", ticket)
    streamer.submit(["a"], [cache], [4])
    streamer.flush()
    receiver.landing[0, 4 % receiver.landing.shape[1], 7] ^= 0x20  # a bit flips in flight
    with pytest.raises(KVTransferError, match="bad delta checksum at position 4"):
        receiver.wait("a")
    streamer.close()
