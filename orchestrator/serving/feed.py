"""A token feed: the new tokens of a frontend's requests on one T-node, one message a step.

The frontend listens (:class:`FeedListener`, a TCP server on its own address)
and names its address when it opens a feed on a T-node (the decode model's
``feed`` op); the T-node connects and sends (:class:`FeedSender`) one message
per pipeline step with a row per request the step advanced: its new tokens,
whether it is done, its log-probs if it asked. Not as Triton responses: each of
those costs the T-node a round trip to its tritonserver and the tritonserver a
gRPC write, on the T-node's own cores (~0.2 ms a response here), where a
message is one ``send`` (ZeroMQ, tried first, cost twice that: its I/O thread
wakes for each message). Dynamo's workers stream their responses to its
frontend over TCP in the same way.

A message is a length-prefixed frame: the feed's id, its number and its rows
(JSON), signed with the cluster secret over all three; a listener takes a
feed's messages in order only, so none is forged, replayed or taken twice. A
sender never waits long on a listener that stopped reading: it gives the feed
up (the frontend is gone; Triton cancels its requests' streams).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from orchestrator.control.auth import MAC_BYTES, mac
from orchestrator.engine.log_probs import TokenLogProb

log = logging.getLogger(__name__)

# (request id, new tokens, their log-probs or None, is it done)
FeedRow = tuple[str, list[int], list[TokenLogProb] | None, bool]
Deliver = Callable[[list[FeedRow]], None]
_LENGTH, _HEAD = struct.Struct("!I"), struct.Struct("!BQ")  # frame bytes; id bytes, number
_MAX_FRAME = 1 << 20  # a step's rows: a few KB for 64 requests with their log-probs
_MAX_CONNECTIONS = 256  # one per T-node a frontend's stream reaches, and some to spare
SEND_TIMEOUT_S = 2.0  # a listener that takes nothing this long is given up


def encode_rows(rows: Sequence[FeedRow]) -> bytes:
    return json.dumps([[rid, tokens, done, None if lp is None else [p.to_list() for p in lp]]
                       for rid, tokens, lp, done in rows]).encode()


def decode_rows(data: bytes) -> list[FeedRow]:
    return [(rid, tokens, None if lp is None else [TokenLogProb.from_list(p) for p in lp], done)
            for rid, tokens, done, lp in json.loads(data)]


def frame(secret: bytes, feed_id: bytes, number: int, payload: bytes) -> bytes:
    head = _HEAD.pack(len(feed_id), number) + feed_id
    body = head + mac(secret, head + payload) + payload
    return _LENGTH.pack(len(body)) + body


def unframe(secret: bytes, body: bytes) -> tuple[bytes, int, bytes]:
    """(feed id, number, payload) of a frame's body; raises PermissionError if forged."""
    id_bytes, number = _HEAD.unpack_from(body)
    head_end = _HEAD.size + id_bytes
    head, signature = body[:head_end], body[head_end : head_end + MAC_BYTES]
    payload = body[head_end + MAC_BYTES :]
    if not hmac.compare_digest(signature, mac(secret, head + payload)):
        raise PermissionError("bad signature: not made with the cluster secret")
    return head[_HEAD.size :], number, payload


class RowSink(Protocol):
    """Where a T-node puts a feed's rows: a :class:`FeedSender` (a test's recorder)."""

    def send(self, rows: Sequence[FeedRow]) -> None: ...

    def close(self) -> None: ...


class FeedSender:
    """A T-node's end of one feed: a connection to the frontend's listener."""

    def __init__(self, address: str, feed_id: str, secret: bytes) -> None:
        """``address``: the listener's host:port. Raises OSError if it cannot be reached."""
        host, _, port = address.rpartition(":")
        self.feed_id, self.secret, self.number = feed_id.encode(), secret, 0
        self.socket: socket.socket | None = socket.create_connection((host, int(port)),
                                                                     SEND_TIMEOUT_S)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step: no wait
        self.lock = threading.Lock()

    def send(self, rows: Sequence[FeedRow]) -> None:
        with self.lock:
            if self.socket is None:
                return  # given up: its requests end with their streams
            self.number += 1
            try:
                self.socket.sendall(frame(self.secret, self.feed_id, self.number,
                                          encode_rows(rows)))
            except OSError as exc:  # gone, or not reading for SEND_TIMEOUT_S
                log.warning("token feed %s: its listener is lost (%s); giving the feed up",
                            self.feed_id.decode(), exc)
                self._close()

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None


class FeedListener:
    """A frontend's end of its feeds: a TCP server every T-node connects to, a thread per
    connection handing each feed's verified messages to what subscribed to it."""

    def __init__(self, secret: bytes, host: str | None = None) -> None:
        """``host``: where to listen (default ``$DEJAVU_HOST``, else loopback, as every node)."""
        self.secret = secret
        host = host or os.environ.get("DEJAVU_HOST", "127.0.0.1")
        self.server = socket.create_server((host, 0))
        self.address = f"{_reachable(host)}:{self.server.getsockname()[1]}"  # for T-nodes
        self._feeds: dict[bytes, tuple[Deliver, Callable[[], None], list[int]]] = {}
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="feed-listener", daemon=True).start()

    def subscribe(self, feed_id: str, deliver: Deliver, lost: Callable[[], None]) -> None:
        """``deliver(rows)`` each message of the feed, in order; ``lost()`` if its connection
        breaks while subscribed."""
        with self._lock:
            self._feeds[feed_id.encode()] = (deliver, lost, [0])

    def unsubscribe(self, feed_id: str) -> None:
        with self._lock:
            self._feeds.pop(feed_id.encode(), None)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._connections) >= _MAX_CONNECTIONS:
                    log.warning("token feed listener: %d connections already; refusing one",
                                len(self._connections))
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._read, args=(conn,), name="feed-reader",
                             daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        carried: set[bytes] = set()  # the feeds this connection brought
        stream = conn.makefile("rb")
        try:
            while (length := stream.read(_LENGTH.size)) and len(length) == _LENGTH.size:
                (size,) = _LENGTH.unpack(length)
                if size > _MAX_FRAME:
                    raise ValueError(f"a feed frame of {size} B")
                body = stream.read(size)
                if len(body) != size:
                    break
                try:
                    carried.add(self._take(body))
                except (PermissionError, ValueError) as exc:  # one bad message: not the rest
                    log.warning("token feed message refused: %s", exc)
        except (OSError, ValueError) as exc:
            log.warning("token feed connection dropped: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
                lost = [self._feeds[f][1] for f in carried if f in self._feeds]
            conn.close()
            for report in lost:  # still subscribed: its node went away mid-feed
                report()

    def _take(self, body: bytes) -> bytes:
        feed_id, number, payload = unframe(self.secret, body)
        with self._lock:
            subscribed = self._feeds.get(feed_id)
        if subscribed is None:
            return feed_id  # a feed this frontend ended
        deliver, _, last = subscribed
        if number <= last[0]:
            raise PermissionError(f"feed {feed_id!r}: message {number} after {last[0]} "
                                  "(a replay)")
        last[0] = number
        deliver(decode_rows(payload))
        return feed_id

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self.server.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # its reader ends


def _reachable(host: str) -> str:
    """The address peers reach a socket bound on ``host`` at: this machine's own name's
    address for a wildcard (a container's or pod's network)."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return socket.gethostbyname(socket.gethostname())
    except ValueError:  # a name
        pass
    return host
