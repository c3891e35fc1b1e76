"""A token feed's wire format: the new tokens of several requests in one response.

A T-node answers each pipeline step with one feed response per feed (the
``feed`` output, one JSON string): a row per request the step advanced, its
new tokens, whether it is done, and its log-probs if it asked. One tensor, not
one per field: a Python-backend tensor costs a serialization and an IPC copy each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from orchestrator.engine.log_probs import TokenLogProb

# (request id, new tokens, their log-probs or None, is it done)
FeedRow = tuple[str, list[int], list[TokenLogProb] | None, bool]


def encode_rows(rows: Sequence[FeedRow]) -> bytes:
    return json.dumps([[rid, tokens, done, None if lp is None else [p.to_list() for p in lp]]
                       for rid, tokens, lp, done in rows]).encode()


def decode_rows(data: bytes | str) -> list[FeedRow]:
    return [(rid, tokens, None if lp is None else [TokenLogProb.from_list(p) for p in lp], done)
            for rid, tokens, done, lp in json.loads(data)]
