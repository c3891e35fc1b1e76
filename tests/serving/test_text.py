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
