"""Tokenizers: load one from a model folder, or train a small byte-level BPE offline.

Dummy checkpoints need a real tokenizer without a model hub, so we train one on
a built-in corpus. Special tokens sit at fixed ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchestrator.engine.config import ModelConfig

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# A plain chat template (Jinja, as transformers reads it) for the dummy checkpoints.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2

CORPUS = """\
Large language models answer a prompt in two phases. The prompt phase reads the whole
prompt at once and writes the key and value cache of every layer; it is limited by
compute. The token phase then produces one token at a time, reading the weights and the
cache for every step; it is limited by memory bandwidth. Running both phases on the same
machines makes them wait for each other, so a serving system may split them: prompt
machines prefill, token machines decode, and the cache streams from one to the other,
layer by layer, while the next layer is still being computed.
A pipeline splits the layers of a model into stages that run on different machines.
Each stage keeps the cache of its own layers. When a machine fails, the cache it held
can be restored from a replica that its neighbour kept in host memory, and generation
resumes from the last step that every stage acknowledged, with the same tokens as before.
The quick brown fox jumps over the lazy dog. A small model with random weights still
needs a tokenizer, a configuration and a file of tensors, so that the same code can load
it and a real checkpoint alike. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100,
1000 and 2024 appear in text, and so do names, dates, questions and answers: what time
is it? Where is the server? How many tokens per second does the token machine produce?
"""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on :data:`CORPUS`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write the files ``transformers.AutoTokenizer.from_pretrained`` reads."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **specials,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


def end_and_pad_ids(model_dir: str | Path, tokenizer: Tokenizer) -> tuple[int | None, int | None]:
    """The tokenizer's end and pad token ids, as the TensorRT-LLM backend's preprocessing
    fills in a request's missing ``end_id`` / ``pad_id``: ``eos_token`` and ``pad_token``
    of ``tokenizer_config.json`` (no pad token: the end token); no ``eos_token`` there:
    ``config.json``'s ``eos_token_id``. ``None`` where the model has none."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}

    def token_id(name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken written out
            token = token.get("content")
        if not token:
            return None
        found = tokenizer.token_to_id(token)
        if found is None:  # not one token of the vocabulary: the backend takes its first
            ids = tokenizer.encode(token, add_special_tokens=False).ids
            found = ids[0] if ids else None
        return found

    end = token_id("eos_token")
    if end is None and (Path(model_dir) / "config.json").is_file():
        end = ModelConfig.from_dir(model_dir).eos_id
    pad = token_id("pad_token")
    return end, end if pad is None else pad
