"""Text in and out: tokenize prompts, detokenize tokens as they stream.

Streaming sends a few tokens at a time, and a token's text can depend on the
ones before it (merged spaces, multi-byte characters split across tokens). So
each streamed response carries the last ``CONTEXT_TOKENS`` tokens already sent;
the new text is what the new tokens add to that context's text. This keeps
the postprocessing model stateless.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from orchestrator.serving.params import RequestError, parse_words

CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        raise RequestError("empty prompt: text_input is empty")
    ids = tokenizer.encode(text).ids
    if not ids:
        raise RequestError(f"prompt {text[:40]!r} has no tokens")
    return ids


def new_text(tokenizer: Tokenizer, context: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``context`` (both token ids)."""
    before = tokenizer.decode(context, skip_special_tokens=True)
    after = tokenizer.decode(context + new, skip_special_tokens=True)
    if after.startswith(before):
        return after[len(before) :]
    # The context's text ended in half a character the new tokens complete.
    before = before.rstrip(REPLACEMENT)
    return after[len(before) :]


def encode_words(tokenizer: Tokenizer, values: list[bytes | str]) -> str:
    """``stop_words`` / ``bad_words`` of one row (the backend's string form) as a JSON list
    of token lists, each word tokenized alone as the backend does."""
    return json.dumps([tokenizer.encode(word, add_special_tokens=False).ids
                       for word in parse_words(values)])


def response_text(tokenizer: Tokenizer, tokens: list[int], context: list[int],
                  full_text: bool) -> str:
    """``full_text``: the text of context + tokens (a non-streaming answer that holds its
    prompt); else the text the tokens add after the context."""
    if full_text:
        return tokenizer.decode(context + tokens, skip_special_tokens=True)
    return new_text(tokenizer, context, tokens)
