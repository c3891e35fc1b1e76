"""How big a request may be, checked at the frontend before any work is done for it.

A prompt's text is refused by its size in bytes before it is tokenized: a prompt
longer than the context times the tokenizer's longest token (in UTF-8 bytes) can
never fit, so that is the default limit (``max_prompt_bytes`` in the node
configuration sets another). Token ids are refused by count before anything looks
at their values. Both take a fraction of a millisecond whatever the size, so a
huge request costs the others nothing but the copy Triton makes of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from orchestrator.engine.config import ModelConfig
from orchestrator.serving.config import NodeConfig
from orchestrator.serving.params import RequestError


@dataclass(frozen=True)
class RequestLimits:
    max_seq_len: int  # tokens of prompt + new tokens a KV slot holds
    vocab_size: int
    max_prompt_bytes: int

    @classmethod
    def for_node(cls, config: NodeConfig, tokenizer: Tokenizer | None = None) -> RequestLimits:
        """From a node's configuration (``max_seq_len``, ``max_prompt_bytes``); the byte
        limit defaults from ``tokenizer`` if given (else 0: no text reaches this node)."""
        model = ModelConfig.from_dir(config.model_dir)
        max_seq_len = config.max_seq_len or model.max_positions
        limit = config.max_prompt_bytes
        if limit is None:
            limit = 0 if tokenizer is None else prompt_bytes_limit(max_seq_len, tokenizer)
        return cls(max_seq_len, model.vocab_size, limit)

    def check_text(self, array: np.ndarray) -> str:
        """The one prompt string of a ``[1]`` BYTES tensor, refused above the byte limit
        before it is decoded."""
        if array.size != 1:
            raise RequestError(f"text_input must hold one string, got shape {list(array.shape)}")
        value = array.reshape(-1)[0]
        raw = value if isinstance(value, bytes) else str(value).encode()
        if len(raw) > self.max_prompt_bytes:
            raise RequestError(
                f"prompt of {len(raw)} bytes exceeds the limit of {self.max_prompt_bytes} bytes "
                f"({self.max_seq_len} tokens of context)"
            )
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"text_input is not UTF-8: {exc}") from None

    def check_ids(self, array: np.ndarray) -> list[int]:
        """Prompt token ids, refused by count before their values are read."""
        if array.size > self.max_seq_len:
            raise RequestError(f"prompt of {array.size} tokens does not fit the context "
                               f"of {self.max_seq_len}")
        return array.reshape(-1).tolist()


def prompt_bytes_limit(max_seq_len: int, tokenizer: Tokenizer) -> int:
    """The default prompt byte limit: a longer text can never fit ``max_seq_len`` tokens."""
    return max_seq_len * longest_token_bytes(tokenizer)


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of the longest entry in the vocabulary (an upper bound on what one
    token of a prompt stands for, for byte-level and SentencePiece vocabularies)."""
    return max(len(token.encode()) for token in tokenizer.get_vocab())
