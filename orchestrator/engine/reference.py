"""The single-process reference: stages chained in one process (``dejavu run``).

Every distributed path (disaggregated, pipelined, swapped, recovered) must
produce the tokens this produces.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from orchestrator.engine.config import ModelConfig
from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.engine.torch_engine import TorchEngine, load_engine
from orchestrator.layout import StageSpec


def generate(
    engines: Sequence[TorchEngine],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_id: int | None = None,
    sampling: SamplingParams | None = None,
) -> list[list[int]]:
    """New tokens per prompt: prefill the batch, then decode until ``max_tokens`` or ``eos_id``.

    ``engines`` are the stages in order. A finished sequence leaves the batch;
    its ``eos_id`` token, when hit, is kept as the last output token. Each
    sequence samples with its own generator, so its tokens never depend on
    which other sequences share its batch.
    """
    if not engines:
        raise ValueError("no engines")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    max_seq_len = min(e.max_seq_len for e in engines)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + max_tokens - 1 > max_seq_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + {max_tokens} new exceed "
                f"max_seq_len {max_seq_len}"
            )
    if not prompts:
        return []
    base = sampling or SamplingParams()
    samplers = [Sampler(base.for_prompt(p)) for p in prompts]
    caches = [[engine.new_cache() for _ in prompts] for engine in engines]

    def sample(rows: list[int], logits: torch.Tensor) -> list[int]:
        return [int(samplers[i](logits[j : j + 1])[0]) for j, i in enumerate(rows)]

    x: list[torch.Tensor] = [torch.tensor(p, dtype=torch.long) for p in prompts]
    for engine, stage_caches in zip(engines, caches, strict=True):
        x = engine.prefill(x, stage_caches)
    outputs = [[t] for t in sample(list(range(len(prompts))), torch.stack(x))]

    def running(i: int) -> bool:
        return len(outputs[i]) < max_tokens and outputs[i][-1] != eos_id

    active = [i for i in range(len(prompts)) if running(i)]
    while active:
        h = torch.tensor([outputs[i][-1] for i in active], dtype=torch.long)
        for engine, stage_caches in zip(engines, caches, strict=True):
            h = engine.decode(h, [stage_caches[i] for i in active])
        for i, t in zip(active, sample(active, h), strict=True):
            outputs[i].append(t)
        active = [i for i in active if running(i)]
    return outputs


def log_softmax_along(
    engines: Sequence[TorchEngine], prompt: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """``[len(output_ids), vocab]``: the model's log-softmax at each position that made an
    output token, feeding ``output_ids`` back (what served log-probs must equal)."""
    caches = [engine.new_cache() for engine in engines]
    x: list[torch.Tensor] = [torch.tensor(prompt, dtype=torch.long)]
    for engine, cache in zip(engines, caches, strict=True):
        x = engine.prefill(x, [cache])
    rows = [x[0]]
    for token in output_ids[:-1]:
        h = torch.tensor([token], dtype=torch.long)
        for engine, cache in zip(engines, caches, strict=True):
            h = engine.decode(h, [cache])
        rows.append(h[0])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def load_stages(
    model_dir: str | Path,
    depth: int = 1,
    device: str = "cpu",
    layers: Sequence[int] | None = None,
    **kwargs,
) -> list[TorchEngine]:
    """The model split into ``depth`` stages (evenly, or ``layers`` per stage), each its own
    engine (``kwargs`` go to ``load_engine``)."""
    num_layers = ModelConfig.from_dir(model_dir).num_layers
    return [
        load_engine(model_dir, stage, device, **kwargs)
        for stage in StageSpec.split(num_layers, depth, layers)
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dejavu run", description="generate in one process (the reference path)"
    )
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stages", type=int, default=1, help="split into K chained stages")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print ids and text as JSON")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    args = parser.parse_args(argv)

    try:
        tokenizer = load_tokenizer(args.model)
        engines = load_stages(args.model, args.stages, args.device)
        eos = None if args.ignore_eos else engines[-1].config.eos_id
        prompt_ids = [tokenizer.encode(p).ids for p in args.prompts]
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        outputs = generate(engines, prompt_ids, args.max_tokens, eos, sampling)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    results = [
        {"prompt": p, "prompt_ids": ids, "output_ids": out, "text": tokenizer.decode(out)}
        for p, ids, out in zip(args.prompts, prompt_ids, outputs, strict=True)
    ]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(r["prompt"] + r["text"])
    return 0
