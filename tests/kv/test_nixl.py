"""Real two-process KV streaming over NIXL (UCX on loopback), and peers killed with SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest
import torch
from nixl_peers import SECRET, decode_node, model_kv, prefill_node

from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.transport.nixl import NixlTransport
from orchestrator.layout import KVCache, KVLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # spawned processes
MODEL = KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, max_seq_len=64)
CTX = mp.get_context("spawn")


def spawn(target, *args) -> tuple[mp.Process, mp.Queue, mp.Queue]:
    inbox, outbox = CTX.Queue(), CTX.Queue()
    args = (inbox, outbox, *args) if target is prefill_node else (outbox, *args)
    process = CTX.Process(target=target, args=args, daemon=True)
    process.start()
    return process, inbox, outbox


def expect(outbox: mp.Queue, what: str, process: mp.Process):
    """The child's next message, failing fast if it died instead."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            kind, value = outbox.get(timeout=0.2)
        except queue.Empty:
            assert process.is_alive(), f"child exited with {process.exitcode} before {what!r}"
            continue
        assert kind == what, (kind, value)
        return value
    raise TimeoutError(f"child sent no {what!r} in 30 s")


def kill(process: mp.Process) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)


@pytest.mark.parametrize("checksum", [False, True])
def test_prompt_and_deltas_round_trip_between_processes(checksum: bool) -> None:
    """One prefill process streams to two token stages (layers split 1 -> 2)."""
    prompt_len, deltas = 37, 3
    process, inbox, outbox = spawn(prefill_node, MODEL.to_dict(), 7, prompt_len, deltas, None)
    stages = [MODEL.layers(0, 2), MODEL.layers(2, 2)]
    receivers = [
        KVReceiver(NixlTransport(), layout, 2, SECRET, timeout_s=10, checksum=checksum)
        for layout in stages
    ]
    try:
        sender_name = expect(outbox, "ready", process)
        inbox.put([r.reserve("req", prompt_len) for r in receivers])
        expected = model_kv(MODEL.to_dict(), 7)
        for receiver, layout in zip(receivers, stages, strict=True):
            cache, extra = receiver.wait("req")
            assert extra == b"first-token"
            rows = expected[layout.first_layer : layout.first_layer + layout.num_layers]
            assert torch.equal(cache.data[:, :, :, :prompt_len], rows[:, :, :, :prompt_len])
        expect(outbox, "done", process)
        # Deltas went to the first stage's slot: positions prompt_len .. prompt_len + 2.
        replica = receivers[0].cache("req")
        deadline = time.monotonic() + 5
        while replica.length < prompt_len + deltas and time.monotonic() < deadline:
            replica = receivers[0].cache("req")
        n = prompt_len + deltas
        assert replica.length == n
        assert torch.equal(replica.data[:, :, :, :n], expected[:2, :, :, :n])
        assert replica.data[:, :, :, n:].abs().sum() == 0
        assert sender_name == "prefill-child"
    finally:
        process.join(timeout=10)
        for receiver in receivers:
            receiver.transport.close()


def test_receiver_names_a_prefill_process_killed_mid_transfer() -> None:
    process, inbox, outbox = spawn(prefill_node, MODEL.to_dict(), 3, 20, 0, 1)
    receiver = KVReceiver(NixlTransport(), MODEL, 1, SECRET, timeout_s=10)
    try:
        expect(outbox, "ready", process)
        inbox.put([receiver.reserve("req", 20)])
        expect(outbox, "stalled", process)
        kill(process)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match=r"waiting for layers \[2, 3\]") as info:
            receiver.wait("req", timeout_s=1.0)
        assert info.value.peer == "prefill-child"
        assert time.monotonic() - start < 3
    finally:
        receiver.transport.close()


def test_sender_names_a_decode_process_killed_mid_transfer() -> None:
    process, _, outbox = spawn(decode_node, MODEL.to_dict(), 20)
    sender = KVSender(NixlTransport(), MODEL, SECRET)
    try:
        handle = sender.start("req", [expect(outbox, "ticket", process)])
        cache = KVCache(MODEL, model_kv(MODEL.to_dict(), 1), 20)
        sender.save_layer(handle, 0, cache)
        kill(process)
        for layer in range(1, MODEL.num_layers):
            sender.save_layer(handle, layer, cache)
            time.sleep(0.05)
        sender.finish(handle, b"")
        start = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            sender.wait_for_save(handle, timeout_s=3)
        assert info.value.peer == "decode-child"
        assert time.monotonic() - start < 3.5
    finally:
        sender.transport.close()
