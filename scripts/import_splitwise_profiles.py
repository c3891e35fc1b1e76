"""Write the shipped Splitwise profiles from SplitwiseSim's measured ``data/perf_model.csv``.

Source: Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase
Splitting", ISCA 2024 (arXiv 2311.18677); the authors' simulator repository
github.com/Mutinifni/splitwise-sim, file ``data/perf_model.csv`` (vLLM on DGX
machines, TP 8, 5 repeats per point), MIT License, (c) 2024 Pratyush Patel.

Usage: python scripts/import_splitwise_profiles.py perf_model.csv OUT_DIR

The CSV measures prefill (``prompt_time``, ms) for batch x prompt size, and the
mean token step (``token_time``, ms) along two axes: batch size at 512-token
prompts, and context at batch 1. Prefill is keyed by the batch's prompt tokens
(the median over repeats and over points with the same total, as SplitwiseSim's
own model does). The decode grid is filled additively from the two axes:
ms(b, c) = ms_batch(b) + ms_context(c) - ms_context(c_ref), the context of a
row being prompt + token_size / 2 (the mean over its generated tokens).
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from orchestrator.profiles.profile import EngineProfile, Machine

GIB = 1 << 30
GPU_MEMORY = 80 * GIB  # configs/hardware_repo/processors/*-80gb.yaml: memory_size
MODELS = {  # name: (parameters, KV bytes per token in float16: 2 x layers x kv heads x dim x 2)
    "llama2-70b": (70e9, 2 * 80 * 8 * 128 * 2),
    "bloom-176b": (176e9, 2 * 70 * 112 * 128 * 2),
}
MACHINES = {  # SKU TDP: configs/hardware_repo/skus/*.yaml; cost: notebooks/utils.py
    "a100-80gb": Machine("dgx-a100", "8x a100-80gb, TP 8", 2.21,
                         "SplitwiseSim notebooks/utils.py a100_cost (relative units)", 6500,
                         "SKU TDP, configs/hardware_repo/skus/dgx-a100.yaml"),
    "h100-80gb": Machine("dgx-h100", "8x h100-80gb, TP 8", 4.76,
                         "SplitwiseSim notebooks/utils.py h100_cost (relative units)", 10200,
                         "SKU TDP, configs/hardware_repo/skus/dgx-h100.yaml"),
}
SOURCE = ("Splitwise (Patel et al., ISCA 2024, arXiv 2311.18677), measured by its authors: "
          "github.com/Mutinifni/splitwise-sim data/perf_model.csv (vLLM, TP 8, median of 5 "
          "repeats); written by scripts/import_splitwise_profiles.py")
LICENSE = "MIT License, Copyright (c) 2024 Pratyush Patel (splitwise-sim)"
BATCH_PROMPT = 512  # the prompt size of the CSV's batch sweep


def _median(rows: list[dict], column: str) -> float:
    return statistics.median(float(r[column]) for r in rows)


def build(rows: list[dict], model: str, hardware: str) -> EngineProfile:
    rows = [r for r in rows if (r["model"], r["hardware"], r["tensor_parallel"])
            == (model, hardware, "8")]
    if not rows:
        raise ValueError(f"no TP 8 rows for {model} on {hardware}")
    by_total: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_total[int(r["prompt_size"]) * int(r["batch_size"])].append(r)
    totals = sorted(by_total)

    batch_rows: dict[int, list[dict]] = defaultdict(list)
    context_rows: dict[float, list[dict]] = defaultdict(list)
    for r in rows:
        prompt, batch, tokens = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
        if prompt == BATCH_PROMPT and tokens == 128:
            batch_rows[batch].append(r)
        if batch == 1:
            context_rows[prompt + tokens / 2].append(r)
    c_ref = BATCH_PROMPT + 128 / 2
    batches, contexts = sorted(batch_rows), sorted(context_rows)
    by_batch = {b: _median(batch_rows[b], "token_time") for b in batches}
    by_context = {c: _median(context_rows[c], "token_time") for c in contexts}
    grid = tuple(
        tuple(round(by_batch[b] + by_context[c] - by_context[c_ref], 3) for c in contexts)
        for b in batches
    )
    params, kv_per_token = MODELS[model]
    return EngineProfile(
        name=f"splitwise-{model}-{hardware.split('-')[0]}",
        model=model,
        machine=MACHINES[hardware],
        prefill_tokens=tuple(totals),
        prefill_ms=tuple(round(_median(by_total[t], "prompt_time"), 3) for t in totals),
        decode_batch=tuple(batches),
        decode_context=tuple(contexts),
        decode_ms=grid,
        kv_bytes_per_token=kv_per_token,
        kv_memory_bytes=8 * GPU_MEMORY - 2 * params,  # float16 weights take the rest
        source=SOURCE,
        license=LICENSE,
        extra={"decode_grid": "additive: batch sweep at 512-token prompts + context sweep "
                              "at batch 1, referenced at context 576",
               "kv_memory": "8 x 80 GiB less float16 weights"},
    )


def main(argv: list[str]) -> int:
    csv_path, out_dir = Path(argv[0]), Path(argv[1])
    rows = list(csv.DictReader(csv_path.open()))
    for model in MODELS:
        for hardware in MACHINES:
            profile = build(rows, model, hardware)
            profile.save(out_dir / f"{profile.name}.json")
            print(out_dir / f"{profile.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
