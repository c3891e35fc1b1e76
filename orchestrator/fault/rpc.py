"""JSON messages over gRPC generic handlers: no protoc step, still real gRPC/HTTP2.

Every method takes and returns one JSON object. Every call is signed with the
cluster secret (metadata ``dejavu-auth``: a signature of the service, the method
and the request's bytes, with a time and a nonce, :mod:`orchestrator.control.auth`);
an unsigned, badly signed, stale or replayed call is refused with ``UNAUTHENTICATED``.
Errors travel as gRPC status codes with a message; the client side turns them back
into :class:`grpc.RpcError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc

from orchestrator.control.auth import Unauthenticated, Verifier, sign

SERVICE = "dejavu.Controller"
AUTH_KEY = "dejavu-auth"

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


def service_handler(methods: dict[str, Handler], secret: bytes,
                    service: str = SERVICE) -> grpc.GenericRpcHandler:
    """``methods`` as a gRPC service that answers calls signed with ``secret`` only, each
    once."""
    verifier = Verifier(secret)

    def wrap(name: str, handler: Handler):
        def call(data: bytes, context: grpc.ServicerContext) -> dict:
            signature = dict(context.invocation_metadata()).get(AUTH_KEY)
            try:
                verifier.verify(signature, service, name, data)
            except Unauthenticated as e:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: {e}")
            try:
                return handler(_decode(data))
            except RequestError as e:
                context.abort(e.code, str(e))
            except (KeyError, TypeError, ValueError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e!r}")

        return grpc.unary_unary_rpc_method_handler(call, response_serializer=_encode)

    return grpc.method_handlers_generic_handler(
        service, {name: wrap(name, h) for name, h in methods.items()}
    )


# A kept channel to a controller that went away retries its connection at most this often
# (gRPC's default backs off up to 120 s): a controller started again is seen within ~1 s.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class Stub:
    """Calls ``service`` methods by name, signed: ``stub.call("Heartbeat", {...}, timeout_s)``.
    One channel for its life: callers that ask often keep one."""

    def __init__(self, address: str, secret: bytes, service: str = SERVICE) -> None:
        self.address, self.secret, self.service = address, secret, service
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)

    def call(self, method: str, request: dict, timeout_s: float) -> dict:
        rpc = self._channel.unary_unary(f"/{self.service}/{method}",
                                        response_deserializer=_decode)
        data = _encode(request)
        return rpc(data, timeout=timeout_s,
                   metadata=[(AUTH_KEY, sign(self.secret, self.service, method, data))])

    def close(self) -> None:
        self._channel.close()
