"""Streamed detokenization: the pieces add up to the whole text."""

import random
import subprocess
import sys

from orchestrator.engine.tokenizer import train_tokenizer
from orchestrator.serving.text import CONTEXT_TOKENS, encode_prompt, new_text


def test_streamed_pieces_concatenate_to_the_full_text():
    tokenizer = train_tokenizer(400)
    rng = random.Random(0)
    text = "The prompt phase reads the whole prompt at once; the token phase follows."
    ids = encode_prompt(tokenizer, text)
    for _ in range(20):
        pieces, sent, i = [], [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            pieces.append(new_text(tokenizer, sent[-CONTEXT_TOKENS:], ids[i : i + n]))
            sent += ids[i : i + n]
            i += n
        assert "".join(pieces) == tokenizer.decode(ids) == text


def test_the_frontend_nodes_library_code_does_not_load_torch():
    # Tokenizing, routing and relaying need no tensors: four frontend stubs each loading
    # torch would cost seconds of CPU at every start (and hundreds of MB).
    modules = ["orchestrator.serving.entry", "orchestrator.serving.text",
               "orchestrator.serving.limits", "orchestrator.control.auth",
               "orchestrator.engine.tokenizer", "orchestrator.serving.params"]
    code = f"import sys; [__import__(m) for m in {modules}]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_a_t_nodes_stub_does_not_load_torch():
    # The stub relays to its token service's own process, which holds the engine: sixteen
    # emulated nodes on one host each saved ~1.7 s of CPU at start and ~150 MB without it.
    modules = ["orchestrator.serving.service_process", "orchestrator.serving.control_request",
               "orchestrator.engine.log_probs", "orchestrator.serving.params",
               "orchestrator.control.errors"]
    code = f"import sys; [__import__(m) for m in {modules}]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_a_missing_end_id_and_pad_id_are_the_tokenizers_as_the_backends_preprocessing(
        tiny_model, tmp_path):
    """The backend's preprocessing fills a missing END_ID with the tokenizer's eos_token and
    PAD_ID with its pad_token (the eos when it has none); a sent one (-1 too) passes on."""
    import json
    import shutil

    import numpy as np

    from orchestrator.engine.config import ModelConfig
    from orchestrator.engine.tokenizer import end_and_pad_ids, load_tokenizer
    from orchestrator.serving.limits import RequestLimits
    from orchestrator.serving.text import encode_batch

    model = tiny_model("llama")
    tokenizer = load_tokenizer(model)
    assert end_and_pad_ids(model, tokenizer) == (2, 0)  # </s>, <pad>
    limits = RequestLimits(256, 512, 1000)
    prompts = np.array([[b"Hi"], [b"Where"]], dtype=np.object_)
    filled = encode_batch(tokenizer, limits, {"text_input": prompts}, (2, 0))
    assert filled["end_id"].tolist() == [[2], [2]] and filled["pad_id"].tolist() == [[0], [0]]
    sent = encode_batch(tokenizer, limits, {"text_input": prompts,
                                            "end_id": np.array([[-1], [-1]], np.int32)}, (2, 0))
    assert sent["end_id"].tolist() == [[-1], [-1]] and sent["pad_id"].tolist() == [[0], [0]]
    assert encode_batch(tokenizer, limits, {"text_input": prompts})["end_id"].tolist() == [
        [-1], [-1]]  # a tokenizer without an end token: none
    no_pad = tmp_path / "no-pad"
    shutil.copytree(model, no_pad)
    config = json.loads((no_pad / "tokenizer_config.json").read_text())
    del config["pad_token"], config["eos_token"]
    (no_pad / "tokenizer_config.json").write_text(json.dumps(config))
    # no eos_token: config.json's eos_token_id; no pad_token: the end token
    assert end_and_pad_ids(no_pad, tokenizer) == (ModelConfig.from_dir(model).eos_id, 2)
