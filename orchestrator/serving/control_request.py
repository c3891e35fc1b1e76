"""What a T-node's Triton stub hands its token service: kept apart from
:mod:`orchestrator.serving.token_service` so that the stub, a relay to the service's own
process (:mod:`orchestrator.serving.service_process`), never imports torch. Sixteen nodes on
one host each saved a torch import (~1.7 s of CPU) and ~150 MB of memory that way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from orchestrator.engine.log_probs import TokenLogProb


@dataclass(frozen=True)
class ControlRequest:
    """A control operation's inputs: the Triton request id, the prompt's length (``reserve``)
    and its arguments (the ``peers`` tensor)."""

    request_id: str = ""
    prompt_len: int = 0
    args: tuple[bytes, ...] = ()


class Emit(Protocol):
    """New tokens, their log-probs (None: not asked for), is this the last response, and on
    the last one (colocated) the prompt's tokens the prefix cache held and the cache's KV
    events for the request's router (signed), when any."""

    def __call__(self, tokens: list[int], log_probs: list[TokenLogProb] | None, final: bool,
                 cached_tokens: int = 0, kv_events: bytes | None = None, /) -> None: ...
