"""Prefill on prompt stages, stream KV layer by layer, decode on token stages: token-exact.

The disaggregated run must generate exactly the greedy tokens of the
single-process reference (``orchestrator.engine.reference.generate``) on the
same weights, through real engines, with the prompt and token pipelines cut
differently (1 -> 2 and 2 -> 3 stages).
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.reference import generate
from orchestrator.engine.torch_engine import load_engine
from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.transport.local import LocalFabric, LocalTransport
from orchestrator.layout import StageSpec

SECRET = b"disagg"
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 8], [1, 2, 3, 4]]
NEW_TOKENS = 6
MAX_SEQ = 32


def make_transports(kind: str, count: int):
    if kind == "local":
        fabric = LocalFabric()
        return [LocalTransport(fabric) for _ in range(count)]
    from orchestrator.kv.transport.nixl import NixlTransport

    return [NixlTransport() for _ in range(count)]


def disaggregated_generate(model_dir, depth_p: int, depth_t: int, transport: str) -> list[list]:
    num_layers = load_engine(model_dir, max_seq_len=MAX_SEQ).stage.num_layers
    p_engines = [
        load_engine(model_dir, s, max_seq_len=MAX_SEQ) for s in StageSpec.split(num_layers, depth_p)
    ]
    t_engines = [
        load_engine(model_dir, s, max_seq_len=MAX_SEQ) for s in StageSpec.split(num_layers, depth_t)
    ]
    transports = make_transports(transport, depth_p + depth_t)
    senders = [
        KVSender(tr, e.kv_layout, SECRET, checksum=True)
        for tr, e in zip(transports[:depth_p], p_engines, strict=True)
    ]
    receivers = [
        KVReceiver(tr, e.kv_layout, len(PROMPTS), SECRET, timeout_s=10)
        for tr, e in zip(transports[depth_p:], t_engines, strict=True)
    ]
    rids = [f"req-{i}" for i in range(len(PROMPTS))]
    try:
        # Decode side reserves; the tickets go to every prompt stage.
        tickets = {
            rid: [r.reserve(rid, len(p)) for r in receivers]
            for rid, p in zip(rids, PROMPTS, strict=True)
        }
        x = [torch.tensor(p) for p in PROMPTS]
        for sender, engine in zip(senders, p_engines, strict=True):
            handles = [sender.start(rid, tickets[rid]) for rid in rids]

            def stream_layer(layer, caches, sender=sender, handles=handles):
                for handle, cache in zip(handles, caches, strict=True):
                    sender.save_layer(handle, layer, cache)

            x = engine.prefill(x, [engine.new_cache() for _ in rids], on_layer=stream_layer)
            first = [int(row.argmax()) for row in x] if engine.stage.is_last else None
            for i, handle in enumerate(handles):
                sender.finish(handle, extra=str(first[i]).encode() if first else b"")
                sender.wait_for_save(handle, timeout_s=10)
        # Token stages: only the streamed caches and the first token, no prompt recompute.
        caches, outputs = [], []
        for rid in rids:
            got = [r.wait(rid) for r in receivers]
            caches.append([cache for cache, _ in got])
            outputs.append([int(got[0][1])])
        for _ in range(NEW_TOKENS - 1):
            h = torch.tensor([out[-1] for out in outputs])
            for stage, engine in enumerate(t_engines):
                h = engine.decode(h, [c[stage] for c in caches])
            for out, token in zip(outputs, h.argmax(-1).tolist(), strict=True):
                out.append(token)
        return outputs
    finally:
        for transport_ in transports:
            transport_.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize(("depth_p", "depth_t"), [(1, 2), (2, 3)])
def test_disaggregated_tokens_equal_the_reference(tiny_model, arch, depth_p, depth_t) -> None:
    model_dir = tiny_model(arch)
    expected = generate([load_engine(model_dir, max_seq_len=MAX_SEQ)], PROMPTS, NEW_TOKENS)
    assert disaggregated_generate(model_dir, depth_p, depth_t, "local") == expected


@pytest.mark.timeout(60)
def test_disaggregated_tokens_over_nixl(tiny_model) -> None:
    model_dir = tiny_model("gpt2")
    expected = generate([load_engine(model_dir, max_seq_len=MAX_SEQ)], PROMPTS, NEW_TOKENS)
    assert disaggregated_generate(model_dir, 2, 3, "nixl") == expected
