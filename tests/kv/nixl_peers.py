"""Child-process roles for the two-process NIXL tests (spawned, so importable here)."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

SECRET = b"nixl-test-secret"


def model_kv(layout_dict: dict, seed: int) -> torch.Tensor:
    """The same random KV in every process."""
    from orchestrator.layout import KVLayout

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(KVLayout(**layout_dict).shape, generator=generator)


def prefill_node(
    inbox: mp.Queue,
    outbox: mp.Queue,
    layout_dict: dict,
    seed: int,
    prompt_len: int,
    deltas: int,
    stall_after_layer: int | None,
) -> None:
    """Stream a prompt's KV layer by layer to the tickets it is sent, then ``deltas`` steps."""
    from orchestrator.kv.connector import KVSender
    from orchestrator.kv.delta import DeltaStreamer
    from orchestrator.kv.transport.base import KVPoll
    from orchestrator.kv.transport.nixl import NixlTransport
    from orchestrator.layout import KVCache, KVLayout

    layout = KVLayout(**layout_dict)
    transport = NixlTransport(name="prefill-child")
    sender = KVSender(transport, layout, SECRET)
    # Deltas go to the first token stage (layers 0, 1), as a replica stream would.
    first_stage = layout.layers(0, 2)
    streamer = DeltaStreamer(transport, first_stage, SECRET, max_batch=1, timeout_s=5)
    outbox.put(("ready", transport.name))
    tickets = inbox.get(timeout=30)
    cache = KVCache(layout, model_kv(layout_dict, seed), prompt_len)
    handle = sender.start("req", tickets)
    for layer in range(layout.num_layers):
        sender.save_layer(handle, layer, cache)
        if layer == stall_after_layer:
            deadline = time.monotonic() + 10  # the layers so far land; then hang until killed
            while sender.poll(handle) == KVPoll.TRANSFERRING and time.monotonic() < deadline:
                if all(t.state == KVPoll.SUCCESS for t in handle.transfers):
                    break
                time.sleep(0.001)
            outbox.put(("stalled", layer))
            time.sleep(60)
    sender.finish(handle, extra=b"first-token")
    sender.wait_for_save(handle, timeout_s=10)
    if deltas:
        streamer.add_target("req", tickets[0])
        stage_cache = KVCache(first_stage, cache.data[:2], prompt_len)
        for step in range(deltas):
            streamer.submit(["req"], [stage_cache], [prompt_len + step])
        streamer.flush(timeout_s=10)
    streamer.close()
    outbox.put(("done", None))


def decode_node(outbox: mp.Queue, layout_dict: dict, prompt_len: int) -> None:
    """Reserve a slot, hand out the ticket, then wait until killed."""
    from orchestrator.kv.connector import KVReceiver
    from orchestrator.kv.transport.nixl import NixlTransport
    from orchestrator.layout import KVLayout

    transport = NixlTransport(name="decode-child")
    receiver = KVReceiver(transport, KVLayout(**layout_dict), 1, SECRET)
    outbox.put(("ticket", receiver.reserve("req", prompt_len)))
    time.sleep(60)
