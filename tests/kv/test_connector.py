"""KVSender -> KVReceiver over the in-process transport: regrouping, and every fault."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

import pytest
import torch

from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.base import KVPoll, Pair, TransferHandle
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.kv.wire import BlockHeader, BlockKind, encode_header
from orchestrator.layout import KVCache, KVLayout, StageSpec

SECRET = b"s3cret"
MODEL = KVLayout(num_layers=6, num_kv_heads=2, head_dim=4, max_seq_len=16)


class Cluster:
    """Prompt and token stages of one model on a local fabric."""

    def __init__(self, depth_p: int, depth_t: int, checksum: bool = False, **overrides) -> None:
        self.fabric = LocalFabric()
        self.p_ranges, self.t_ranges = (
            [range(s.first_layer, s.last_layer) for s in StageSpec.split(MODEL.num_layers, depth)]
            for depth in (depth_p, depth_t)
        )
        self.receivers = [
            KVReceiver(self.node(f"t{i}"), MODEL.layers(r.start, len(r)), 2, SECRET,
                       timeout_s=0.5, checksum=checksum)
            for i, r in enumerate(self.t_ranges)
        ]  # fmt: skip
        sender_layout = {**MODEL.to_dict(), **overrides}
        self.senders = [
            KVSender(self.node(f"p{i}"), KVLayout(**sender_layout).layers(r.start, len(r)),
                     SECRET)
            for i, r in enumerate(self.p_ranges)
        ]  # fmt: skip

    def node(self, name: str, cls=LocalTransport) -> LocalTransport:
        return cls(self.fabric, name)

    def reserve(self, rid: str, prompt_len: int) -> list[bytes]:
        return [r.reserve(rid, prompt_len) for r in self.receivers]

    def prompt_caches(self, full: torch.Tensor) -> list[KVCache]:
        return [
            KVCache(s.layout, full[r.start : r.stop].clone(), 0)
            for s, r in zip(self.senders, self.p_ranges, strict=True)
        ]

    def send(self, rid: str, tickets: Sequence[bytes], full: torch.Tensor, extra: bytes) -> None:
        for stage, (sender, cache) in enumerate(
            zip(self.senders, self.prompt_caches(full), strict=True)
        ):
            handle = sender.start(rid, list(tickets))
            for layer in self.p_ranges[stage]:
                sender.save_layer(handle, layer, cache)
            sender.finish(handle, extra if stage == len(self.senders) - 1 else b"")
            sender.wait_for_save(handle, timeout_s=1)


@pytest.mark.parametrize(("depth_p", "depth_t"), [(1, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("checksum", [False, True])
def test_prompt_kv_arrives_exactly_across_regrouped_stages(depth_p, depth_t, checksum) -> None:
    cluster = Cluster(depth_p, depth_t, checksum)
    full = torch.randn(MODEL.shape)
    tickets = cluster.reserve("r1", 11)
    assert cluster.receivers[0].poll("r1") == KVPoll.WAITING
    cluster.send("r1", tickets, full, extra=b"\x2a")
    for receiver, layers in zip(cluster.receivers, cluster.t_ranges, strict=True):
        assert receiver.poll("r1") == KVPoll.SUCCESS
        cache, extra = receiver.wait("r1")
        assert extra == b"\x2a" and cache.length == 11
        assert cache.layout.first_layer == layers.start
        assert torch.equal(cache.data[:, :, :, :11], full[layers.start : layers.stop, :, :, :11])
        assert cache.data[:, :, :, 11:].abs().sum() == 0  # nothing beyond the prompt written
        receiver.release("r1")


@pytest.mark.parametrize(("depth_p", "depth_t"), [(1, 1), (2, 3)])
@pytest.mark.parametrize("checksum", [False, True])
def test_a_receiver_holding_a_prefix_is_sent_only_the_rest(depth_p, depth_t, checksum) -> None:
    """Decode-side reuse: positions a token stage filled at reservation are never sent; the
    slot ends with its own prefix and the sender's rest."""
    cluster = Cluster(depth_p, depth_t, checksum)
    full, mine = torch.randn(MODEL.shape), torch.randn(MODEL.shape)

    def fill(slot: KVCache) -> int:
        first = slot.layout.first_layer
        slot.data[:, :, :, :5] = mine[first : first + slot.layout.num_layers, :, :, :5]
        return 5

    tickets = [r.reserve("r1", 11, fill) for r in cluster.receivers]
    sent = []
    for stage, (sender, cache) in enumerate(
            zip(cluster.senders, cluster.prompt_caches(full), strict=True)):
        handle = sender.start("r1", tickets)
        for layer in cluster.p_ranges[stage]:
            sender.save_layer(handle, layer, cache)
        sender.finish(handle, b"\x2a" if stage == len(cluster.senders) - 1 else b"")
        sender.wait_for_save(handle, timeout_s=1)
        sent.append(handle.sent_bytes)
    assert sum(sent) == 6 * MODEL.num_layers * MODEL.token_bytes_per_layer()  # 11 - 5 a layer
    for receiver, layers in zip(cluster.receivers, cluster.t_ranges, strict=True):
        cache, _ = receiver.wait("r1")
        assert cache.length == 11
        assert torch.equal(cache.data[:, :, :, :5], mine[layers.start : layers.stop, :, :, :5])
        assert torch.equal(cache.data[:, :, :, 5:11], full[layers.start : layers.stop, :, :, 5:11])


@pytest.mark.parametrize(("depth_p", "depth_t"), [(1, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize(("held", "ahead"), [(0, 8), (5, 8), (8, 5)])
@pytest.mark.parametrize("checksum", [False, True])
def test_cached_positions_go_ahead_of_every_layer_then_each_layer_sends_the_rest(
        depth_p, depth_t, held, ahead, checksum) -> None:
    """A prompt whose first ``ahead`` positions the sender had cached: ``save_ahead`` posts
    them for every layer at once (one write per token stage, of the positions its slot does
    not hold), before any layer's ``save_layer``, which then posts only the later positions.
    The slot ends whole, and no byte more is sent than without it."""
    cluster = Cluster(depth_p, depth_t, checksum)
    full, mine = torch.randn(MODEL.shape), torch.randn(MODEL.shape)

    def fill(slot: KVCache) -> int:
        first = slot.layout.first_layer
        slot.data[:, :, :, :held] = mine[first : first + slot.layout.num_layers, :, :, :held]
        return held

    tickets = [r.reserve("r1", 11, fill) for r in cluster.receivers]
    row = MODEL.token_bytes_per_layer()
    sent = ahead_sent = 0
    for stage, (sender, cache) in enumerate(
            zip(cluster.senders, cluster.prompt_caches(full), strict=True)):
        handle = sender.start("r1", tickets)
        sender.save_ahead(handle, cache, ahead)
        stage_layers = len(cluster.p_ranges[stage])
        assert handle.ahead_bytes == handle.sent_bytes == max(ahead - held, 0) * stage_layers * row
        for layer in cluster.p_ranges[stage]:
            sender.save_layer(handle, layer, cache)
        with pytest.raises(ValueError, match="before any layer"):
            sender.save_ahead(handle, cache, ahead)
        sender.finish(handle, b"\x2a" if stage == len(cluster.senders) - 1 else b"")
        sender.wait_for_save(handle, timeout_s=1)
        sent, ahead_sent = sent + handle.sent_bytes, ahead_sent + handle.ahead_bytes
    assert sent == (11 - held) * MODEL.num_layers * row  # what the plain path sends
    assert ahead_sent == max(ahead - held, 0) * MODEL.num_layers * row
    for receiver, layers in zip(cluster.receivers, cluster.t_ranges, strict=True):
        cache, extra = receiver.wait("r1")
        assert extra == b"\x2a" and cache.length == 11
        want = full[layers.start : layers.stop, :, :, :11].clone()
        want[:, :, :, :held] = mine[layers.start : layers.stop, :, :, :held]
        assert torch.equal(cache.data[:, :, :, :11], want)
        receiver.release("r1")


def test_a_receiver_waits_for_every_part_of_a_layer_and_takes_none_twice() -> None:
    """A layer sent in parts is whole only once its positions all landed; a part that
    overlaps one landed fails the request, naming it."""
    cluster = Cluster(1, 1)
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    cache = cluster.prompt_caches(torch.randn(MODEL.shape))[0]
    handle = sender.start("r1", cluster.reserve("r1", 11))
    sender.save_ahead(handle, cache, 6)
    sender.finish(handle, b"\x01")  # every layer's positions [6, 11) never sent
    assert receiver.poll("r1") == KVPoll.TRANSFERRING
    sender.release(handle)
    receiver.release("r1")

    handle = sender.start("r2", cluster.reserve("r2", 11))
    sender.save_ahead(handle, cache, 6)
    handle.ahead = 5  # a sender that would send position 5 twice
    sender.save_layer(handle, 0, cache)
    with pytest.raises(KVTransferError, match=r"layers \[0\] positions \[5, 11\) received twice"):
        receiver.wait("r2")
    sender.release(handle)


def test_nothing_ahead_is_the_plain_path() -> None:
    """A prompt with no cached positions: ``save_ahead(..., 0)`` posts nothing, and each
    layer carries all its positions, as without it."""
    cluster = Cluster(1, 2)
    sender = cluster.senders[0]
    full = torch.randn(MODEL.shape)
    cache = cluster.prompt_caches(full)[0]
    tickets = cluster.reserve("r1", 11)
    handle = sender.start("r1", tickets)
    sender.save_ahead(handle, cache, 0)
    assert handle.transfers == [] and handle.ahead_bytes == 0
    for layer in cluster.p_ranges[0]:
        sender.save_layer(handle, layer, cache)
    assert len(handle.transfers) == MODEL.num_layers
    sender.finish(handle, b"\x01")
    sender.wait_for_save(handle, timeout_s=1)
    for receiver, layers in zip(cluster.receivers, cluster.t_ranges, strict=True):
        got, _ = receiver.wait("r1")
        assert torch.equal(got.data[:, :, :, :11], full[layers.start : layers.stop, :, :, :11])


def test_a_fill_that_fails_or_holds_the_whole_prompt_holds_nothing() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]

    def broken(slot: KVCache) -> int:
        raise RuntimeError("lost cache")

    for rid, fill in (("a", broken), ("b", lambda slot: 11)):
        ticket = receiver.reserve(rid, 11, fill)
        full = torch.randn(MODEL.shape)
        cluster.send(rid, [ticket], full, extra=b"\x01")
        cache, _ = receiver.wait(rid)
        assert torch.equal(cache.data[:, :, :, :11], full[:, :, :, :11])  # all of it sent
        receiver.release(rid)


def test_reserve_rejects_bad_requests() -> None:
    receiver = Cluster(1, 1).receivers[0]
    with pytest.raises(ValueError, match="prompt_len 17 not in"):
        receiver.reserve("a", 17)
    receiver.reserve("a", 3)
    with pytest.raises(ValueError, match="already holds a slot"):
        receiver.reserve("a", 3)
    receiver.reserve("b", 3)
    with pytest.raises(RuntimeError, match="no free KV slot"):
        receiver.reserve("c", 3)
    with pytest.raises(KeyError, match="holds no slot"):
        receiver.poll("zzz")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_kv_heads": 3}, "KV heads mismatch: ticket has 2, sender 3"),
        ({"head_dim": 8}, "head size mismatch: ticket has 4, sender 8"),
        ({"dtype": "bfloat16"}, "dtype mismatch: ticket has float32, sender bfloat16"),
        ({"max_seq_len": 8}, "prompt length 11 exceeds the sender's max_seq_len 8"),
    ],
)
def test_sender_rejects_mismatched_tickets(override: dict, message: str) -> None:
    cluster = Cluster(1, 1, **override)
    with pytest.raises(KVTransferError, match=message) as info:
        cluster.senders[0].start("r1", cluster.reserve("r1", 11))
    assert info.value.peer == "t0"


def test_sender_rejects_tickets_that_miss_layers_or_name_another_request() -> None:
    cluster = Cluster(1, 2)
    tickets = cluster.reserve("r1", 5)
    with pytest.raises(KVTransferError, match=r"do not hold layers \[3, 4, 5\]"):
        cluster.senders[0].start("r1", tickets[:1])
    with pytest.raises(KVTransferError, match="request id mismatch: ticket has r1, sender r2"):
        cluster.senders[0].start("r2", tickets)


def test_wrong_secret_is_rejected_on_both_sides() -> None:
    cluster = Cluster(1, 1)
    ticket = cluster.reserve("r1", 4)[0]
    rogue = KVSender(cluster.node("rogue"), MODEL, b"guess")
    with pytest.raises(KVTransferError, match="bad secret: ticket MAC") as info:
        rogue.start("r1", [ticket])
    assert info.value.peer == "t0"
    rogue.transport.add_peer("t0", b"t0")
    forged = BlockHeader.for_layout(BlockKind.FINISH, "r1", MODEL, seq_len=4, payload_bytes=0)
    rogue.transport.notify("t0", encode_header(forged, b"guess"))
    with pytest.raises(KVTransferError, match="bad secret: header MAC") as info:
        cluster.receivers[0].wait("r1")
    assert info.value.peer == "rogue"


def forge(cluster: Cluster, **fields) -> KVTransferError:
    """Send one authentic LAYERS header with ``fields`` changed; return the receiver's error."""
    cluster.reserve("r1", 4)
    sender = cluster.senders[0].transport
    sender.add_peer("t0", b"t0")
    nbytes = 4 * MODEL.token_bytes_per_layer()
    header = BlockHeader.for_layout(
        BlockKind.LAYERS, "r1", MODEL.layers(0, 1), seq_len=4, payload_bytes=nbytes,
        first_position=0, end_position=4,
    )
    header = dataclasses.replace(header, **fields)
    sender.notify("t0", encode_header(header, SECRET))
    with pytest.raises(KVTransferError) as info:
        cluster.receivers[0].wait("r1")
    assert info.value.peer == "p0" and cluster.receivers[0].poll("r1") == KVPoll.FAILED
    return info.value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seq_len": 5}, "sequence length mismatch: block has 5, reserved 4"),
        ({"payload_bytes": 100}, "truncated payload: 100 bytes, expected 256"),
        ({"payload_bytes": 257}, "oversized payload: 257 bytes, expected 256"),
        ({"num_heads": 4}, "KV heads mismatch"),
        ({"head_dim": 2}, "head size mismatch"),
        ({"dtype": "float16"}, "dtype mismatch"),
        ({"num_layers": 7}, "layers mismatch"),
        ({"end_position": 5}, "positions [0, 5) outside the [0, 4) this slot lacks"),
        ({"first_position": 4}, "positions [4, 4) outside"),
    ],
)
def test_receiver_names_each_mismatch(fields: dict, message: str) -> None:
    assert message in str(forge(Cluster(1, 1), **fields))


def test_receiver_requires_a_checksum_when_asked() -> None:
    assert "receiver requires one" in str(forge(Cluster(1, 1, checksum=True)))


class CorruptingTransport(LocalTransport):
    """Flips one byte of the first piece it writes (a bad link / bad memory)."""

    def write(self, peer: str, pairs: Sequence[Pair], notify: bytes = b"") -> TransferHandle:
        handle = super().write(peer, pairs, notify=b"")
        byte = ctypes.c_ubyte.from_address(pairs[0][1].addr)
        byte.value ^= 0x10
        if notify:
            self.fabric.lookup(peer).deliver(self.name, notify)
        return handle


def test_checksum_catches_a_flipped_byte() -> None:
    cluster = Cluster(1, 1, checksum=True)
    cluster.senders[0] = KVSender(cluster.node("bad", CorruptingTransport), MODEL, SECRET)
    tickets = cluster.reserve("r1", 4)
    cluster.send("r1", tickets, torch.randn(MODEL.shape), b"")
    with pytest.raises(KVTransferError, match=r"bad checksum for layers \[0\]") as info:
        cluster.receivers[0].wait("r1")
    assert info.value.peer == "bad"


def test_receiver_times_out_naming_the_silent_sender() -> None:
    cluster = Cluster(1, 1)
    cluster.receivers[0].reserve("idle", 4)
    with pytest.raises(KVTransferError, match="nothing received") as info:
        cluster.receivers[0].wait("idle", timeout_s=0.05)
    assert info.value.peer == "<no sender>"
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    handle = sender.start("r1", cluster.reserve("r1", 4))
    sender.save_layer(handle, 0, cluster.prompt_caches(torch.randn(MODEL.shape))[0])
    cluster.fabric.leave("p0")  # the prefill node dies after one layer
    with pytest.raises(KVTransferError, match=r"waiting for layers \[1, 2, 3, 4, 5\]") as info:
        receiver.wait("r1", timeout_s=0.1)
    assert info.value.peer == "p0"


def test_sender_fails_naming_a_departed_receiver() -> None:
    cluster = Cluster(1, 2)
    sender = cluster.senders[0]
    handle = sender.start("r1", cluster.reserve("r1", 4))
    cache = cluster.prompt_caches(torch.randn(MODEL.shape))[0]
    sender.save_layer(handle, 0, cache)
    cluster.receivers[1].transport.close()  # the second token stage dies
    for layer in range(1, 6):
        sender.save_layer(handle, layer, cache)
    sender.finish(handle)
    with pytest.raises(KVTransferError, match="peer 't1'"):
        sender.wait_for_save(handle, timeout_s=1)
    assert sender.poll(handle) == KVPoll.FAILED


def test_unfinished_send_times_out() -> None:
    cluster = Cluster(1, 1)
    handle = cluster.senders[0].start("r1", cluster.reserve("r1", 4))
    with pytest.raises(KVTransferError, match="finish\\(\\) was not called"):
        cluster.senders[0].wait_for_save(handle, timeout_s=0.01)


def test_failed_slots_are_quarantined_before_reuse() -> None:
    receiver = Cluster(1, 1).receivers[0]
    receiver.reserve("bad", 4)
    with pytest.raises(KVTransferError):
        receiver.wait("bad", timeout_s=0.01)
    receiver.release("bad")
    receiver.reserve("a", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):  # a late writer may still hit it
        receiver.reserve("b", 4)


@pytest.mark.parametrize("released_first", [False, True])
def test_a_slot_every_prefill_stage_gave_up_on_is_free_at_once(released_first: bool) -> None:
    """A prefill that stops early (its client left) tells the token stages that it writes
    nothing more, once its transfers are done: the slot is reused at once, not after the
    late-write wait. A stage still running keeps it waiting."""
    cluster = Cluster(2, 1)  # two prompt stages write into one token stage
    receiver, (first, second) = cluster.receivers[0], cluster.senders
    tickets = cluster.reserve("gone", 4)
    handles = [sender.start("gone", tickets) for sender in cluster.senders]
    cache = cluster.prompt_caches(torch.randn(MODEL.shape))[0]
    first.save_layer(handles[0], cluster.p_ranges[0].start, cache)  # one layer landed
    if released_first:
        receiver.release("gone")  # the T-node saw the cancel before the P-node stopped
    first.release(handles[0])
    if not released_first:
        receiver.release("gone")
    receiver.reserve("other", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):  # the second stage may write
        receiver.reserve("next", 4)
    second.release(handles[1])
    receiver.reserve("next", 4)  # every writer is done: the slot is free


def test_a_sender_reads_that_the_token_stage_ended_its_request() -> None:
    """The frontend never cancels the P-node's call: it ends the request on the token side,
    which marks the slot ended; the P-node reads that between layers and stops. A request
    still running, one that landed whole, and another request's slot read not ended."""
    cluster = Cluster(1, 1)
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    left, stays = cluster.reserve("left", 4), cluster.reserve("stays", 4)
    handle = sender.start("left", left)  # connected, one layer on its way
    sender.save_layer(handle, 0, cluster.prompt_caches(torch.randn(MODEL.shape))[0])
    assert not sender.ended(left[0]) and not sender.ended(stays[0])
    receiver.release("left")  # its client left: the head ended it
    assert sender.ended(left[0]) and not sender.ended(stays[0])
    sender.release(handle)  # it stops: its writers are done, the slot is free again
    receiver.reserve("next", 4)
    cluster.send("stays", stays, torch.randn(MODEL.shape), b"x")
    receiver.wait("stays")
    receiver.release("stays")  # used: free at once, never marked
    assert not sender.ended(stays[0])


def test_a_prompt_given_up_before_it_started_frees_its_slot() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]
    cluster.senders[0].give_up("early", cluster.reserve("early", 4))
    receiver.release("early")
    receiver.reserve("a", 4)
    receiver.reserve("b", 4)  # both slots


def test_a_slot_whose_claimed_writer_ended_is_free_once_told() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]
    cluster.senders[0].claim("lost", cluster.reserve("lost", 4))  # nothing written yet
    receiver.release("lost")  # a writer may still write: the slot waits it out
    receiver.writers_ended(["another-node"])
    receiver.reserve("a", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):
        receiver.reserve("b", 4)
    receiver.writers_ended(["p0"])  # the claim named it: nothing can come from it now
    receiver.reserve("b", 4)


def test_a_slot_released_after_its_writer_ended_is_free_at_once() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]
    cluster.senders[0].claim("lost", cluster.reserve("lost", 4))
    receiver.writers_ended(["p0"])
    receiver.release("lost")
    receiver.reserve("a", 4)
    receiver.reserve("b", 4)  # both slots


def test_an_unclaimed_slot_waits_out_a_late_writer_whoever_ended() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]
    cluster.reserve("unknown", 4)
    receiver.release("unknown")
    receiver.writers_ended(["p0"])  # the writer is not known: it may be another
    receiver.reserve("a", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):
        receiver.reserve("b", 4)


def test_an_abort_without_the_secret_frees_nothing() -> None:
    cluster = Cluster(1, 1)
    receiver = cluster.receivers[0]
    cluster.reserve("gone", 4)
    receiver.release("gone")
    forged = encode_header(BlockHeader.for_layout(BlockKind.ABORT, "gone", MODEL, seq_len=4,
                                                  payload_bytes=0), b"not the secret")
    intruder = cluster.node("intruder")
    intruder.add_peer("t0", b"t0")
    intruder.notify("t0", forged)
    receiver.reserve("a", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):
        receiver.reserve("b", 4)


def test_sender_bounds_requests_in_flight() -> None:
    cluster = Cluster(1, 1)
    sender = KVSender(cluster.node("small"), MODEL, SECRET, max_inflight=1)
    sender.start("a", cluster.reserve("a", 4))
    with pytest.raises(KVTransferError, match="all 1 staging blocks are in flight"):
        sender.start("b", cluster.reserve("b", 4))


def test_sender_rejects_overlapping_token_stages() -> None:
    cluster = Cluster(1, 1)
    twin = KVReceiver(cluster.node("twin"), MODEL, 1, SECRET)
    tickets = cluster.reserve("r1", 5) + [twin.reserve("r1", 5)]
    with pytest.raises(KVTransferError, match="overlap") as info:
        cluster.senders[0].start("r1", tickets)
    assert info.value.peer == "t0,twin"


class FakeClock:
    """Monotonic and wall time for the connector and its tickets, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    from orchestrator.kv import connector, wire

    fake = FakeClock()
    monkeypatch.setattr(connector, "time", fake)
    monkeypatch.setattr(wire, "time", fake)
    return fake


def ttl_cluster(ttl_s: float = 10.0) -> Cluster:
    cluster = Cluster(1, 1)
    cluster.receivers = [KVReceiver(cluster.node("t-ttl"), MODEL, 2, SECRET, timeout_s=30,
                                    reserve_ttl_s=ttl_s)]
    return cluster


def test_unused_reservations_expire_and_their_slots_come_back(clock) -> None:
    """Abandoned reservations (a client that reserved and left) cannot hold every slot."""
    receiver = ttl_cluster().receivers[0]
    receiver.reserve("a", 4)
    receiver.reserve("b", 4)
    with pytest.raises(RuntimeError, match="no free KV slot"):
        receiver.reserve("c", 4)
    clock.now += 9
    assert receiver.held() == 2
    clock.now += 2
    assert receiver.held() == 0
    with pytest.raises(KeyError, match="holds no slot"):
        receiver.poll("a")
    with pytest.raises(RuntimeError, match="no free KV slot"):  # a write posted at the deadline
        receiver.reserve("c", 4)
    clock.now += 2.5  # ... has landed by now; not the 30 s of a failed transfer
    receiver.reserve("c", 4)
    receiver.reserve("d", 4)


def test_a_reservation_in_use_does_not_expire(clock) -> None:
    cluster = ttl_cluster()
    receiver = cluster.receivers[0]
    tickets = cluster.reserve("r1", 4)
    assert receiver.poll("r1") == KVPoll.WAITING  # the pipeline asked for it: it is in use
    cluster.send("r1", tickets, torch.randn(MODEL.shape), extra=b"\x01")
    clock.now += 60
    assert receiver.held() == 1
    assert receiver.cache("r1").length == 4


def test_an_expired_ticket_writes_nothing(clock) -> None:
    cluster = ttl_cluster()
    full = torch.randn(MODEL.shape)
    late = cluster.reserve("late", 4)
    clock.now += 11
    with pytest.raises(KVTransferError, match="ticket expired"):
        cluster.senders[0].start("late", late)
    # A send that began in time stops writing at the deadline.
    sender, cache = cluster.senders[0], cluster.prompt_caches(full)[0]
    handle = sender.start("slow", cluster.reserve("slow", 4))
    sender.save_layer(handle, 0, cache)
    clock.now += 11
    sender.save_layer(handle, 1, cache)
    with pytest.raises(KVTransferError, match=r"ticket expired before layers \[1\]"):
        sender.wait_for_save(handle, timeout_s=1)


def test_a_filled_reservation_nobody_takes_is_freed_at_once(clock) -> None:
    """A raw prefill into a raw reservation: every write landed, so no grace is needed."""
    cluster = ttl_cluster()
    cluster.send("raw", cluster.reserve("raw", 4), torch.randn(MODEL.shape), extra=b"\x01")
    clock.now += 11
    assert cluster.receivers[0].held() == 0
    cluster.receivers[0].reserve("a", 4)
    cluster.receivers[0].reserve("b", 4)
