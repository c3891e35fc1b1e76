"""What one request's prompt cost on the nodes: the one place the frontend records it.

The frontend fills a :class:`RequestUsage` per sequence as the nodes report
(:meth:`~orchestrator.serving.frontend.Frontend.generate`); every response of
the sequence carries it (the ``cached_tokens`` output, OpenAI's
``usage.prompt_tokens_details.cached_tokens``, and whatever other contract
reports reuse reads it from here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestUsage:
    cached_tokens: int = 0  # prompt tokens whose KV came from a node's prefix cache
