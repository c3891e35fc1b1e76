"""Our configs against the TensorRT-LLM backend's published ones (vendored, with their
source, in ``trtllm_contract/``): every input and output the backend declares is declared
here with the same name, data type, dims, reshape and ragged batching; every difference is
listed below, so a drift on either side fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# What the templates (tools/fill_template.py) leave open: any value passes where the
# published config has one of these (a dtype left open matches any dtype).
OPEN = {"triton_max_batch_size": "64", "decoupled_mode": "true",
        "logits_datatype": "TYPE_INVALID", "encoder_input_features_data_type": "TYPE_INVALID"}
# Required in the published config, optional here: Triton 2.51 answers a request that lacks
# a required input of an ensemble with HTTP 200 and an error text, and a gRPC stream waits,
# so the model refuses a missing max_tokens itself, with an error naming it.
MADE_OPTIONAL = {"ensemble": {"max_tokens"}, "tensorrt_llm_bls": {"max_tokens"}}
# This project's own tensors (in the contract table of the report and the models' configs).
EXTRA_INPUTS = {
    "ensemble": {"min_length", "random_seed", "top_log_probs", "num_draft_tokens",
                 "use_draft_logits", "image_input", "image_bytes_input", "image_url_input",
                 "video_bytes_input", "cache_salt"},
    "tensorrt_llm_bls": {"min_length", "random_seed", "top_log_probs", "cache_salt"},
    "tensorrt_llm": {"cache_salt"}, "postprocessing": set(),
}
EXTRA_OUTPUTS = {
    "ensemble": {"output_ids", "output_top_log_probs", "output_top_log_prob_ids",
                 "cached_tokens"},
    "tensorrt_llm_bls": {"output_ids", "output_top_log_probs", "output_top_log_prob_ids",
                         "cached_tokens"},
    "tensorrt_llm": {"cached_tokens"}, "postprocessing": set(),
}


def load(path: Path) -> mc.ModelConfig:
    text = re.sub(r"\$\{(\w+)\}", lambda m: OPEN.get(m.group(1), "0"), path.read_text())
    text = re.sub(r'string_value: "0"', 'string_value: ""', text)
    return text_format.Parse(text, mc.ModelConfig())


def tensors(entries) -> dict[str, tuple]:
    return {t.name: (t.data_type, list(t.dims), t.HasField("reshape") and list(t.reshape.shape),
                     t.allow_ragged_batch if hasattr(t, "allow_ragged_batch") else False)
            for t in entries}


def same(published: tuple, ours: tuple) -> bool:
    dtype, *rest = published
    return (dtype in (mc.TYPE_INVALID, ours[0])) and rest == list(ours[1:])


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm", "tensorrt_llm_bls",
                                   "postprocessing"])
def test_configs_match_the_published_contract(model):
    published = load(HERE / "trtllm_contract" / f"{model}.pbtxt")
    ours = load(REPO / "model_repository" / model / "config.pbtxt")
    assert ours.max_batch_size > 0 and published.max_batch_size > 0  # both batched
    if published.HasField("model_transaction_policy"):  # left open by the template
        assert ours.model_transaction_policy.decoupled
    for kind, extra in (("input", EXTRA_INPUTS), ("output", EXTRA_OUTPUTS)):
        theirs, mine = tensors(getattr(published, kind)), tensors(getattr(ours, kind))
        assert set(theirs) - set(mine) == set(), f"{model} lacks {kind}s"
        assert set(mine) - set(theirs) == extra[model], f"{model}'s own {kind}s"
        wrong = {name: (spec, mine[name]) for name, spec in theirs.items()
                 if not same(spec, mine[name])}
        assert wrong == {}, f"{model} {kind}s differ (published, ours)"
    optional = {t.name for t in ours.input if t.optional}
    required = {t.name for t in published.input if not t.optional}
    assert {t.name for t in published.input if t.optional} <= optional
    assert required & optional == MADE_OPTIONAL.get(model, set())


def test_the_llmapi_config_matches_the_published_contract():
    """``--trtllm-api llmapi``'s tensorrt_llm against TensorRT-LLM's LLM-API model
    (``trtllm_contract/llmapi/``): the same inputs and outputs, names, types, dims and
    optional ones, none of our own; unbatched (its model.yaml's max_batch_size 0)."""
    published = load(HERE / "trtllm_contract" / "llmapi" / "tensorrt_llm.pbtxt")
    ours = load(REPO / "model_repository" / "tensorrt_llm_llmapi" / "config.pbtxt")
    assert ours.max_batch_size == published.max_batch_size == 0
    for kind in ("input", "output"):
        assert tensors(getattr(ours, kind)) == tensors(getattr(published, kind)), kind
    assert ({t.name for t in ours.input if t.optional}
            == {t.name for t in published.input if t.optional})
