"""JSON messages over gRPC generic handlers: no protoc step, still real gRPC/HTTP2.

Every method takes and returns one JSON object. Errors travel as gRPC status
codes with a message; the client side turns them back into :class:`RpcError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc

SERVICE = "dejavu.Controller"

Handler = Callable[[dict], dict]


class RequestError(ValueError):
    """A request the controller rejects; ``code`` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def _encode(message: dict) -> bytes:
    return json.dumps(message).encode()


def _decode(data: bytes) -> dict:
    message = json.loads(data or b"{}")
    if not isinstance(message, dict):
        raise ValueError("a message must be a JSON object")
    return message


def service_handler(methods: dict[str, Handler]) -> grpc.GenericRpcHandler:
    def wrap(handler: Handler):
        def call(request: dict, context: grpc.ServicerContext) -> dict:
            try:
                return handler(request)
            except RequestError as e:
                context.abort(e.code, str(e))
            except (KeyError, TypeError, ValueError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e!r}")

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=_decode, response_serializer=_encode
        )

    return grpc.method_handlers_generic_handler(
        SERVICE, {name: wrap(h) for name, h in methods.items()}
    )


class Stub:
    """Calls ``SERVICE`` methods by name: ``stub.call("Heartbeat", {...}, timeout_s)``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address)

    def call(self, method: str, request: dict, timeout_s: float) -> dict:
        rpc = self._channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode
        )
        return rpc(request, timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()
