"""Request size limits, checked before any work (orchestrator/serving/limits.py)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.config import NodeConfig
from orchestrator.serving.limits import RequestLimits, longest_token_bytes
from orchestrator.serving.params import RequestError


def test_the_byte_limit_defaults_from_the_context_and_the_longest_token(model):
    tokenizer = load_tokenizer(model)
    limits = RequestLimits.for_node(NodeConfig(role="frontend", model_dir=str(model),
                                               max_seq_len=64, decode_urls=(("a",),),
                                               prefill_urls=("b",)), tokenizer)
    assert limits.max_prompt_bytes == 64 * longest_token_bytes(tokenizer)
    # Nothing that fits the context is refused: the longest tokens, all 64 of them.
    longest = max(tokenizer.get_vocab(), key=lambda t: len(t.encode()))
    text = tokenizer.decode([tokenizer.token_to_id(longest)] * 64)
    assert limits.check_text(np.array([text.encode()], dtype=np.object_)) == text
    with pytest.raises(RequestError, match="exceeds the limit"):
        limits.check_text(np.array([b"x" * (limits.max_prompt_bytes + 1)], dtype=np.object_))
    with pytest.raises(RequestError, match="not UTF-8"):
        limits.check_text(np.array([b"\xff\xfe"], dtype=np.object_))


def test_a_configured_limit_and_token_ids_refused_by_count(model):
    config = NodeConfig(role="frontend", model_dir=str(model), max_prompt_bytes=10,
                        decode_urls=(("a",),), prefill_urls=("b",))
    limits = RequestLimits.for_node(config, load_tokenizer(model))
    assert limits.max_prompt_bytes == 10
    with pytest.raises(RequestError, match="11 bytes"):
        limits.check_text(np.array([b"x" * 11], dtype=np.object_))
    assert limits.check_ids(np.array([1, 2, 3], dtype=np.int32)) == [1, 2, 3]
    with pytest.raises(RequestError, match="does not fit"):
        limits.check_ids(np.ones(limits.max_seq_len + 1, dtype=np.int32))
