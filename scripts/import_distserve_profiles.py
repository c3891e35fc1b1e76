"""Write the shipped DistServe OPT profiles from DistServe's fitted A100 step-time model.

Source: Zhong et al., "DistServe: Disaggregating Prefill and Decoding for
Goodput-optimized Large Language Model Serving", OSDI 2024 (arXiv 2401.09670); the
authors' repository github.com/LLMServe/DistServe, file
``simdistserve/estimators/profile_data/profiler-a100-80g.distserve.json`` (last
changed in commit 4c68ed9579b515deba2c059ef605473491d7fcfe; read at HEAD
82831f1604cc6b10bebd360f6c437a07790dde9f), Apache License 2.0, Copyright 2024
DistServe Authors.

Usage: python scripts/import_distserve_profiles.py profiler-a100-80g.distserve.json OUT_DIR
(get the file with ``git show HEAD:simdistserve/estimators/profile_data/...`` in a clone).

The file holds no measured points, only least-squares fits (evaluation/1-fit-time-usage)
of DistServe's own engine on A100-80GB, per model and tensor-parallel degree, of
measurements taken by evaluation/0-test-single-forward-performance (batch 1..192,
identical prompts of 4..2020 tokens, 16 output tokens, dummy weights). Its simulator
(simdistserve/estimators/time_estimator.py) reads them as, in ms:

  prefill = a + b * sum(prompt lens) + c * sum(prompt len^2)
  decode  = a + b * sum(context lens) + c * batch   (one coefficient set below batch 95,
                                                     another from 95 up)

We evaluate those formulas on our grids. Our prefill is keyed by the batch's total
prompt tokens N only, so the sum of squares needs an assumed split: prompts of
min(N, 2048) tokens each (one prompt while it fits OPT's 2048-position window, then
full-window prompts), i.e. c * N * min(N, 2048), the longest-prompt (upper) case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.profiles.profile import EngineProfile, Machine

GIB = 1 << 30
GPU_MEMORY = 80 * GIB  # A100-80GB, counted as the Splitwise import does
OPT_WINDOW = 2048  # OPT's max_position_embeddings: no prompt or context is longer
FP16 = 2  # bytes; DistServe serves OPT in float16
# HF configs facebook/opt-*: (layers, hidden, ffn_dim); vocab 50272 for all sizes
OPT_SHAPES = {"opt-13b": (40, 5120, 20480), "opt-66b": (64, 9216, 36864)}
OPT_VOCAB = 50272
# The TP each profile is taken at: the degree DistServe's own benchmark ran the model
# at as one colocated engine (vLLM baseline, evaluation/2-benchmark-serving/
# 2-start-api-server.py), which is also a degree the profiler measured
# (evaluation/0-test-single-forward-performance/main.py). OPT-66B TP 8 is left out on
# purpose: commit 79659a4 copied it from the vLLM curve rather than profiling it.
TP = {"opt-13b": 1, "opt-66b": 4}
# Cross-check only: KV tokens DistServe's memory profiler found room for at this TP,
# PP 1 (simdistserve/estimators/profile_data/max_num_tokens.csv, same commit)
DISTSERVE_MAX_TOKENS = {"opt-13b": 66144, "opt-66b": 78496}
# SplitwiseSim's A100 machine is a DGX of 8 GPUs; a profile on fewer GPUs takes that share
DGX_A100_COST, DGX_A100_POWER_W, DGX_GPUS = 2.21, 6500, 8

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096, 8192, 16384, 32768)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192)  # the profiler's batch sizes
DECODE_CONTEXT = (16, 32, 64, 128, 256, 512, 1024, 2048)  # up to OPT's window

SOURCE = ("DistServe (Zhong et al., OSDI 2024, arXiv 2401.09670): least-squares fits of "
          "its authors' measurements of the DistServe engine on A100-80GB, "
          "github.com/LLMServe/DistServe simdistserve/estimators/profile_data/"
          "profiler-a100-80g.distserve.json (commit 4c68ed9, read at 82831f1), evaluated "
          "on this grid with simdistserve/estimators/time_estimator.py's formulas; written "
          "by scripts/import_distserve_profiles.py")
LICENSE = ("Apache License 2.0 (http://www.apache.org/licenses/LICENSE-2.0), Copyright 2024 "
           "DistServe Authors (LLMServe/DistServe); changed: the fitted coefficients are "
           "evaluated on a grid, not copied")


def opt_parameters(model: str) -> int:
    """Parameters of an OPT model from its shapes (biases, layer norms, tied LM head)."""
    layers, h, f = OPT_SHAPES[model]
    per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    embeddings = OPT_VOCAB * h + (OPT_WINDOW + 2) * h  # OPT's learned positions have 2 extra
    return layers * per_layer + embeddings + 2 * h  # + the final layer norm


def prefill_ms(coef: list[float], tokens: int) -> float:
    a, b, c = coef
    return a + b * tokens + c * tokens * min(tokens, OPT_WINDOW)


def decode_ms(params: dict, batch: int, context: int) -> float:
    # time_estimator.py switches coefficient sets at the threshold (batch < it: small)
    key = "decoding_smallbs" if batch < params["decoding_large_small_bs_threshold"] \
        else "decoding_largebs"
    a, b, c = params[key]
    return a + b * batch * context + c * batch


def build(fits: dict, model: str) -> EngineProfile:
    tp = TP[model]
    params = fits[f"facebook/{model}"][str(tp)]
    layers, hidden, _ = OPT_SHAPES[model]
    weights = FP16 * opt_parameters(model)
    kv_per_token = 2 * layers * hidden * FP16  # K and V, multi-head attention
    share = tp / DGX_GPUS
    machine = Machine(
        name=f"a100-80gb-x{tp}",
        accelerators=f"{tp}x a100-80gb, TP {tp}",
        cost_per_hour=round(DGX_A100_COST * share, 5),
        cost_unit=f"SplitwiseSim notebooks/utils.py a100_cost 2.21 per 8-GPU DGX A100 "
                  f"(relative units) x {tp}/8 GPUs",
        power_w=DGX_A100_POWER_W * share,
        power_note=f"DGX A100 SKU TDP 6.5 kW (SplitwiseSim configs/hardware_repo/skus/"
                   f"dgx-a100.yaml) x {tp}/8 GPUs",
    )
    kv_memory = tp * GPU_MEMORY - weights
    return EngineProfile(
        name=f"distserve-{model}-a100",
        model=model,
        machine=machine,
        prefill_tokens=PREFILL_TOKENS,
        prefill_ms=tuple(round(prefill_ms(params["prefill"], n), 3) for n in PREFILL_TOKENS),
        decode_batch=DECODE_BATCH,
        decode_context=DECODE_CONTEXT,
        decode_ms=tuple(tuple(round(decode_ms(params, b, c), 3) for c in DECODE_CONTEXT)
                        for b in DECODE_BATCH),
        kv_bytes_per_token=kv_per_token,
        kv_memory_bytes=kv_memory,
        source=SOURCE,
        license=LICENSE,
        extra={
            "engine": "DistServe's engine (SwiftTransformer kernels), float16, "
                      f"tensor parallel {tp}, pipeline 1",
            "prefill_formula": "a + b*N + c*N*min(N, 2048) ms, N = the batch's prompt "
                               "tokens: DistServe's a + b*sum(len) + c*sum(len^2) with "
                               "prompts of min(N, 2048) tokens each (the upper case)",
            "prefill_coefficients": params["prefill"],
            "prefill_note": "the file's prefill coefficients carry DistServe's 1.1 "
                            "calibration ('Realign the curve', commit 4c68ed9: fit x 1.1)",
            "decode_formula": "a + b*batch*context + c*batch ms; small-batch set below "
                              f"batch {params['decoding_large_small_bs_threshold']}, "
                              "large-batch set from it",
            "decode_coefficients_small_batch": params["decoding_smallbs"],
            "decode_coefficients_large_batch": params["decoding_largebs"],
            "measured_range": "batch 1..192, prompts 4..2020 tokens, 16 output tokens, "
                              "batch x prompt within the profiler's per-TP token limit; "
                              "outside it the grid extrapolates the fit",
            "kv_memory": f"{tp} x 80 GiB = {tp * GPU_MEMORY} B less float16 weights "
                         f"2 x {opt_parameters(model)} parameters = {weights} B",
            "kv_memory_crosscheck": f"DistServe's max_num_tokens.csv holds "
                                    f"{DISTSERVE_MAX_TOKENS[model]} KV tokens at TP {tp} "
                                    f"(after activations); this file "
                                    f"{kv_memory // kv_per_token}",
        },
    )


def main(argv: list[str]) -> int:
    fits_path, out_dir = Path(argv[0]), Path(argv[1])
    fits = json.loads(fits_path.read_text())
    for model in TP:
        profile = build(fits, model)
        profile.save(out_dir / f"{profile.name}.json")
        print(out_dir / f"{profile.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
