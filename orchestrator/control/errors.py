"""Why an internal request failed, as a code the caller acts on (never the message text).

An internal model (``prefill``, ``decode``) answers a failed request with a
normal response carrying ``error_code`` (an :class:`ErrorCode`) and ``error``
(the message, for people): Triton 2.51's Python backend has no response
parameters, and a plain Triton error carries text only. The frontend decides
from the code whether to wait (``NO_FREE_SLOT``), run the prompt on another
P-node (``KV_TRANSFER``), run the request again (``PIPELINE_LOST``) or give up.

A library's own exception says its code with a class attribute ``error_code``
(the KV library's do), so this module imports no layer above it.
"""

from __future__ import annotations

import enum

from orchestrator.control.auth import Unauthenticated


class ErrorCode(enum.IntEnum):
    INTERNAL = 1  # a bug or an unexpected failure: the message says what
    BAD_REQUEST = 2  # refused as given: never retried
    UNAUTHENTICATED = 3  # not signed with the cluster secret
    NO_FREE_SLOT = 4  # every prompt-KV slot is held: wait and ask again
    KV_TRANSFER = 5  # a KV transfer failed or was refused: the prompt may run elsewhere
    PIPELINE_LOST = 6  # the token pipeline failed a request it had admitted
    NOT_KEPT = 7  # a re-attached request's KV was not kept: run it again from its prompt


class ControlError(RuntimeError):
    """An internal node's failure, with its code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def code_of(error: BaseException) -> ErrorCode:
    """The code of an exception or of the first one in its chain with a code of its own
    (a ``ControlError``, an ``error_code`` attribute, ``Unauthenticated``); otherwise a
    ``ValueError`` (a refused request) is ``BAD_REQUEST``."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ControlError):
            return cause.code
        code = getattr(type(cause), "error_code", None)
        if isinstance(code, ErrorCode):
            return code
        if isinstance(cause, Unauthenticated):
            return ErrorCode.UNAUTHENTICATED
        cause = cause.__cause__
    return ErrorCode.BAD_REQUEST if isinstance(error, ValueError) else ErrorCode.INTERNAL
