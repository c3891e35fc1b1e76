"""The errors the KV library raises: a failed or rejected transfer, no free slot."""

from __future__ import annotations

from orchestrator.control.errors import ErrorCode


class KVTransferError(RuntimeError):
    """A transfer failed, timed out or was rejected; says which peer and why."""

    error_code = ErrorCode.KV_TRANSFER  # the prompt may run on another P-node

    def __init__(self, peer: str, reason: str, request_id: str | None = None) -> None:
        self.peer = peer
        self.reason = reason
        self.request_id = request_id
        where = f"request {request_id!r}, " if request_id is not None else ""
        super().__init__(f"KV transfer ({where}peer {peer!r}): {reason}")


class NoFreeSlot(RuntimeError):
    """Every prompt-KV slot of a receiver is held; one is given back within a step."""

    error_code = ErrorCode.NO_FREE_SLOT  # wait and ask again
