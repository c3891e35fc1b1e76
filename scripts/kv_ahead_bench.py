"""What sending a prefix-cache hit's cached KV ahead of the compute buys (issue 39).

One P-node prompt stage and one T-node receiver in this process, over NIXL (loopback),
the emulated engine timed by a shipped profile (Llama-2-70B on an H100, its KV scaled by
``--kv-heads`` and ``--head-dim``: the emulated KV is float32 in the config's layout). A prompt of
``--prompt`` tokens is prefilled once (stored in the P-node's prefix cache); then
``--runs`` prompts that share its first ``--cached`` fraction are each prefilled through
``stream_prefill``, and for each the script records when the engine's compute began and
when its last layer's compute ended, and when the T-node's receiver had the whole prompt KV
(``poll`` says SUCCESS, watched from a thread). Run it with the checkout to measure on
``PYTHONPATH``: the branch, and the commit before it
(``git archive <commit> orchestrator | tar -x -C DIR``), alternately.

    PYTHONPATH=. .venv/bin/python scripts/kv_ahead_bench.py --label after
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from orchestrator.engine.config import ModelConfig
from orchestrator.engine.emulated import EmulatedEngine
from orchestrator.kv.connector import KVReceiver, KVSender
from orchestrator.kv.prefix_cache import PrefixCache
from orchestrator.kv.transport.base import KVPoll
from orchestrator.kv.transport.nixl import NixlTransport
from orchestrator.layout import StageSpec
from orchestrator.pipeline.prefill import stream_prefill
from orchestrator.pipeline.prefix import PrefixReuse
from orchestrator.profiles.profile import load_profile

SECRET = b"kv-ahead-bench"
BLOCK = 32


def llama2_70b(kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": 28672, "max_position_embeddings": 4096, "vocab_size": 32000})


class Timed:
    """The engine, noting when it started and when its last layer's compute ended (before
    that layer's KV is packed and posted: the stream's cost after the compute)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine, self.started, self.ended = engine, 0.0, 0.0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def prefill(self, inputs, caches, on_layer=None):
        last = self.engine.kv_layout.layer_range[-1]

        def hook(layer, caches):
            if layer == last:
                self.ended = time.perf_counter()
            on_layer(layer, caches)

        self.started = time.perf_counter()
        return self.engine.prefill(inputs, caches, on_layer=hook)


def watch(receiver: KVReceiver, rid: str, done: dict) -> None:
    """Note when the receiver holds the request's whole prompt KV (bounded)."""
    deadline = time.monotonic() + 60
    while receiver.poll(rid) not in (KVPoll.SUCCESS, KVPoll.FAILED):
        if time.monotonic() > deadline:
            return
        time.sleep(0.0001)
    done["at"] = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--cached", type=float, default=0.9)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    config = llama2_70b(args.kv_heads, args.head_dim)
    profile = load_profile("splitwise-llama2-70b-h100")
    engine = Timed(EmulatedEngine(config, StageSpec.whole(config.num_layers), profile,
                                  args.prompt + 8))
    layout = engine.kv_layout
    sender = KVSender(NixlTransport(name="bench-p"), layout, SECRET, max_inflight=1)
    receiver = KVReceiver(NixlTransport(name="bench-t"), layout, 1, SECRET, timeout_s=60)
    prefix = PrefixReuse(PrefixCache(layout, BLOCK, args.prompt // BLOCK + 1))
    base = torch.randint(1, 30000, (args.prompt,), generator=torch.Generator().manual_seed(0))
    shared = int(args.prompt * args.cached) // BLOCK * BLOCK

    def prefill(rid: str, prompt: list[int]) -> dict:
        ticket = receiver.reserve(rid, len(prompt))
        done: dict = {}
        watcher = threading.Thread(target=watch, args=(receiver, rid, done))
        watcher.start()
        cached: dict[str, int] = {}
        start = time.perf_counter()
        stream_prefill([engine], [sender], {rid: prompt}, {rid: [ticket]}, prefix=prefix,
                       cached=cached)
        watcher.join()
        receiver.release(rid)
        return {"cached": cached[rid], "before_compute_s": engine.started - start,
                "compute_s": engine.ended - engine.started, "ready_s": done["at"] - start,
                "tail_s": done["at"] - engine.ended}

    prefill("warm", base.tolist())
    runs = []
    for i in range(args.runs):
        rest = torch.randint(1, 30000, (args.prompt - shared,),
                             generator=torch.Generator().manual_seed(i + 1))
        runs.append(prefill(f"r{i}", base[:shared].tolist() + rest.tolist()))
    token_bytes = layout.token_bytes_per_layer() * layout.num_layers
    print(json.dumps({
        "label": args.label, "prompt": args.prompt, "cached": runs[0]["cached"],
        "kv_bytes_per_token": token_bytes, "kv_scale": engine.engine.kv_scale,
        **{f"{k}_median_ms": round(1e3 * statistics.median(r[k] for r in runs), 2)
           for k in ("before_compute_s", "compute_s", "ready_s", "tail_s")},
        "tail_ms": [round(1e3 * r["tail_s"], 2) for r in runs]}))


if __name__ == "__main__":
    main()
