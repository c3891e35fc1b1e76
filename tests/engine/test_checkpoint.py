"""Dummy checkpoints, their tokenizer, and the ``dejavu model make`` / ``dejavu run`` CLIs."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import pytest
import tokenizers
import transformers

from orchestrator.cli import main
from orchestrator.engine.checkpoint import INIT_STD, PRESETS, hf_config, make_checkpoint
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.tokenizer import load_tokenizer

TEXT = "The prompt streams to the token machine, layer by layer."


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_tokenizer_loads_in_hf_and_tokenizers(tiny_model, arch):
    model_dir = tiny_model(arch)
    config = ModelConfig.from_dir(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert (
        hf(TEXT)["input_ids"] == raw.encode(TEXT).ids == load_tokenizer(model_dir).encode(TEXT).ids
    )
    assert hf.decode(hf(TEXT)["input_ids"]) == TEXT
    assert raw.get_vocab_size() <= config.vocab_size
    bos_id = json.loads((model_dir / "config.json").read_text())["bos_token_id"]
    assert (hf.eos_token_id, hf.bos_token_id) == (config.eos_id, bos_id) == (2, 1)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_model):
    a = (tiny_model("gpt2") / "model.safetensors").read_bytes()
    make_checkpoint("gpt2", "tiny", tmp_path / "same", seed=0)
    make_checkpoint("gpt2", "tiny", tmp_path / "other", seed=1)
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == a
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != a


def test_unknown_arch_or_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'bloom'; choose from gpt2, opt, llama"):
        make_checkpoint("bloom", "tiny", tmp_path)
    with pytest.raises(ValueError, match="unknown preset 'huge' for opt; choose from tiny, small"):
        make_checkpoint("opt", "huge", tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_medium_preset_is_gpt2_medium_sized_and_loads_in_the_engine(arch):
    """Config only: a medium checkpoint is 1.4 GB, too big to write in a unit test."""
    assert set(PRESETS[arch]) == set(INIT_STD) == {"tiny", "small", "medium"}
    config = ModelConfig.from_dict(hf_config(arch, "medium").to_dict())
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.head_dim)
    assert shape == (24, 1024, 16, 64)
    assert config.intermediate_size == {"gpt2": 4096, "opt": 4096, "llama": 2816}[arch]
    assert config.num_kv_heads == (4 if arch == "llama" else 16)


def dejavu(*argv: str) -> subprocess.CompletedProcess:
    """The ``dejavu`` command in this process (a subprocess would import torch and
    transformers again, ~10 s each here): its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse refusing the arguments
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_cli_make_then_run_json(tmp_path):
    model_dir = tmp_path / "llama"
    made = dejavu(
        "model", "make", "--arch", "llama", "--preset", "tiny", "--seed", "3", str(model_dir)
    )
    assert made.returncode == 0, made.stderr
    run = dejavu(
        "run",
        "--model",
        str(model_dir),
        "--max-tokens",
        "5",
        "--stages",
        "2",
        "--ignore-eos",
        "--json",
        "hello world",
        "the cache",
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    tokenizer = load_tokenizer(model_dir)
    assert [r["prompt"] for r in results] == ["hello world", "the cache"]
    for r in results:
        assert r["prompt_ids"] == tokenizer.encode(r["prompt"]).ids
        assert len(r["output_ids"]) == 5
        assert r["text"] == tokenizer.decode(r["output_ids"])

    bad = dejavu("model", "make", "--arch", "llama", "--preset", "nope", str(tmp_path / "x"))
    assert bad.returncode == 2 and "unknown preset 'nope'" in bad.stderr
    missing = dejavu("run", "--model", str(tmp_path / "none"), "hi")
    assert missing.returncode == 2 and "no tokenizer.json" in missing.stderr


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_make_with_more_layers_than_the_preset(tmp_path, arch):
    from orchestrator.engine.checkpoint import main as make

    with contextlib.redirect_stdout(io.StringIO()):
        assert make(["--arch", arch, "--preset", "tiny", "--layers", "6", str(tmp_path)]) == 0
    config = ModelConfig.from_dir(tmp_path)
    assert config.num_layers == 6
    preset = ModelConfig.from_dict(hf_config(arch, "tiny").to_dict())
    assert config.hidden_size == preset.hidden_size and preset.num_layers == 4
