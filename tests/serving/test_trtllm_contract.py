"""Our models against the TensorRT-LLM backend's published configs (vendored, with their
source and license, in ``tests/serving/tensorrtllm_backend/``): same model names, tensor
names, data types, dims, optionality, batching and decoupled settings. A difference fails
unless :data:`DEVIATIONS` names it with its reason, and a deviation that no longer exists
fails too, so the list stays the exact set of differences a client can meet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PUBLISHED = HERE / "tensorrtllm_backend"
# The published configs are templates (tools/fill_template.py): the values a deployment
# of ours corresponds to.
TEMPLATE = {"triton_max_batch_size": "64", "decoupled_mode": "true",
            "logits_datatype": "TYPE_FP32", "encoder_input_features_data_type": "TYPE_FP16",
            "triton_backend": "tensorrtllm", "max_queue_delay_microseconds": "0",
            "max_queue_size": "0", "bls_instance_count": "1",
            "postprocessing_instance_count": "1", "preprocessing_instance_count": "1"}
MODELS = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls", "postprocessing")

# (model, "input"/"output"/"config", name) -> why ours differs. Every entry must still be a
# difference (see test_every_deviation_is_real).
DEVIATIONS: dict[tuple[str, str, str], str] = {}


def load(path: Path) -> mc.ModelConfig:
    text = re.sub(r"\$\{(\w+)\}", lambda m: TEMPLATE.get(m.group(1), '""'), path.read_text())
    return text_format.Parse(text, mc.ModelConfig(), allow_unknown_field=False)


def tensors(config: mc.ModelConfig, kind: str) -> dict[str, tuple]:
    """name -> what a client sees of the tensor (inputs: optionality and reshape too)."""
    found = {}
    for t in getattr(config, kind):
        seen = (mc.DataType.Name(t.data_type), list(t.dims))
        if kind == "input":
            seen += (t.optional, list(t.reshape.shape) if t.HasField("reshape") else None)
        found[t.name] = seen
    return found


def settings(config: mc.ModelConfig) -> dict[str, object]:
    return {"max_batch_size": config.max_batch_size,
            "decoupled": config.model_transaction_policy.decoupled,
            "dynamic_batching": config.HasField("dynamic_batching"),
            "platform": config.platform}


def differences(model: str) -> dict[tuple[str, str, str], str]:
    ours = load(REPO / "model_repository" / model / "config.pbtxt")
    published = load(PUBLISHED / f"{model}.pbtxt")
    found = {}
    for kind in ("input", "output"):
        mine, theirs = tensors(ours, kind), tensors(published, kind)
        for name, seen in theirs.items():
            if mine.get(name) != seen:
                found[(model, kind, name)] = f"published {seen}, ours {mine.get(name)}"
    for name, value in settings(published).items():
        if settings(ours)[name] != value:
            found[(model, "config", name)] = f"published {value}, ours {settings(ours)[name]}"
    return found


@pytest.mark.parametrize("model", MODELS)
def test_configs_match_the_published_contract(model):
    unexplained = {key: what for key, what in differences(model).items()
                   if key not in DEVIATIONS}
    assert not unexplained, unexplained


def test_every_deviation_is_real():
    found = {key for model in MODELS for key in differences(model)}
    assert set(DEVIATIONS) <= found, set(DEVIATIONS) - found


def test_vendored_copies_name_their_source():
    for model in (*MODELS, "preprocessing"):
        head = (PUBLISHED / f"{model}.pbtxt").read_text().splitlines()[:7]
        assert any("c2e65b88d85255be30cf50440a91662abeb497dd" in line for line in head)
        assert any(f"all_models/inflight_batcher_llm/{model}/config.pbtxt" in line
                   for line in head)
        assert any("Apache-2.0" in line for line in head)
