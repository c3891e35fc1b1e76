"""Decode-side reuse on a multi-turn set, real tritonservers: the KV bytes P->T it saves.

1P+1T, the torch engine on a tiny Llama (made here), ``--kv-block`` tokens a block.
``--conversations`` conversations of ``--turns`` turns each (a turn's prompt is the last
one, its answer and a new message of ``--message`` tokens), the conversations' turns sent
side by side, once with the T-node's decode cache off and once on (``decode_cache_mb``):
the greedy tokens of both runs must be equal; it prints the P-node's ``dejavu_kv_bytes``
(KV streamed P->T) and the T-node's ``dejavu_kv_reused_bytes`` (held there, not streamed)
for each run.

    .venv/bin/python scripts/decode_reuse_multiturn.py --out bench_out/decode_reuse_mt
"""

from __future__ import annotations

import argparse
import queue
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.common import metric  # noqa: E402
from orchestrator.cluster.launcher import Cluster  # noqa: E402
from orchestrator.engine.checkpoint import make_checkpoint  # noqa: E402

MAX_SEQ_LEN = 256  # the tiny Llama's positions


def ask(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy answer of the ``tensorrt_llm`` model (no end token: all ``max_tokens``)."""
    inputs = {"input_ids": np.array([prompt], np.int32),
              "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[max_tokens]], np.int32),
              "end_id": np.array([[-1]], np.int32), "streaming": np.array([[False]])}
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result),
                                             results), stream_timeout=120)
        tensors = []
        for name, value in inputs.items():
            tensors.append(grpcclient.InferInput(name, value.shape,
                                                 np_to_triton_dtype(value.dtype)))
            tensors[-1].set_data_from_numpy(value)
        client.async_stream_infer("tensorrt_llm", tensors)
        client.stop_stream()
    ids: list[int] = []
    while not results.empty():
        result = results.get_nowait()
        if isinstance(result, Exception):
            raise result
        ids += result.as_numpy("output_ids").reshape(-1).tolist()
    return ids[len(prompt):]


def run(model: Path, run_dir: Path, args, decode_cache_mb: float) -> tuple[list, float, float]:
    """Every conversation's answers, the P-node's KV bytes sent and the T-node's held."""
    firsts = [[(7 * i + 13 * c) % 500 + 1 for i in range(args.first)]
              for c in range(args.conversations)]
    with Cluster.up(model, run_dir=run_dir, max_seq_len=MAX_SEQ_LEN, prefix_cache_mb=4,
                    decode_cache_mb=decode_cache_mb, kv_block=args.kv_block) as cluster, \
            ThreadPoolExecutor(args.conversations) as pool:
        url = cluster.frontend.grpc_url
        prompts, answers = firsts, []
        for turn in range(args.turns):
            got = list(pool.map(lambda p: ask(url, p, args.max_tokens), prompts))
            answers.append(got)
            prompts = [p + a + [(11 * i + 5 * c + turn) % 500 + 1 for i in range(args.message)]
                       for c, (p, a) in enumerate(zip(prompts, got, strict=True))]
        p_node = f"127.0.0.1:{cluster.role('prefill')[0].server.metrics_port}"
        t_node = f"127.0.0.1:{cluster.role('decode')[0].server.metrics_port}"
        sent = metric(p_node, "dejavu_kv_bytes")
        held = metric(t_node, "dejavu_kv_reused_bytes")
    return answers, sent, held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first", type=int, default=48, help="tokens of a first prompt")
    parser.add_argument("--message", type=int, default=24, help="tokens of each new message")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--kv-block", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench_out/decode_reuse_mt"))
    args = parser.parse_args()
    longest = args.first + (args.turns - 1) * (args.max_tokens + args.message) + args.max_tokens
    if longest > MAX_SEQ_LEN:
        parser.error(f"the last turn needs {longest} positions, the model has {MAX_SEQ_LEN}")
    args.out = args.out.resolve()
    model = args.out / "tiny-llama"
    if not (model / "config.json").is_file():
        make_checkpoint("llama", "tiny", model)
    off = run(model, args.out / "off", args, 0.0)
    on = run(model, args.out / "on", args, 4.0)
    if on[0] != off[0]:
        print("decode-side reuse changed the greedy tokens", file=sys.stderr)
        return 1
    prompt_tokens = sum(args.conversations * (args.first + t * (args.max_tokens + args.message))
                        for t in range(args.turns))
    print(f"{args.conversations} conversations x {args.turns} turns, {prompt_tokens} prompt "
          f"tokens, {args.kv_block}-token blocks: the same greedy tokens with decode-side "
          "reuse off and on")
    print("| decode-side reuse | KV P->T (dejavu_kv_bytes) | held on the T-node, not sent "
          "(dejavu_kv_reused_bytes) |")
    print("|---|---:|---:|")
    for name, (_, sent, held) in (("off", off), ("on", on)):
        print(f"| {name} | {sent:,.0f} | {held:,.0f} |")
    print(f"P->T saved: {1 - on[1] / off[1]:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
