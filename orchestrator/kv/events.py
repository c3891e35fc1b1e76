"""KV events: what a node's prefix cache stored and removed, for a KV-aware router.

A node numbers its cache's events (:class:`KVEventLog`, a bounded log). A reader
(a frontend's router) says where it stopped, a *cursor* ``"<epoch>:<number>"``,
and gets the events after it; a cursor the log can no longer serve (another
epoch: the node started again; or older than the events kept) gets a *reset*:
every block the cache holds now. Each answer is signed with the cluster secret
(:func:`encode_events`), like every internal message, so a router indexes only
what a node of its cluster said.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from collections import deque
from collections.abc import Callable

from orchestrator.control.auth import MAC_BYTES, Unauthenticated, mac
from orchestrator.kv.prefix_cache import KVEvent

KEPT_EVENTS = 4096


class KVEventLog:
    """A node's numbered cache events; ``held()`` lists every block held (for a reset);
    ``secret`` (the cluster's) signs its answers."""

    def __init__(self, held: Callable[[], list[int]], secret: bytes = b"",
                 keep: int = KEPT_EVENTS) -> None:
        self.held, self.secret = held, secret
        self.epoch = os.urandom(6).hex()
        self.number = 0  # of the last event
        self._events: deque[tuple[int, str, tuple[int, ...]]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, event: KVEvent) -> None:
        """The cache's ``on_event``."""
        with self._lock:
            self.number += 1
            self._events.append((self.number, event.kind, event.hashes))

    def since(self, cursor: str) -> dict:
        """What a reader at ``cursor`` ("" at first) has not seen: ``{"cursor": new,
        "events": [[kind, hashes], ...]}``, or ``{"cursor": new, "reset": hashes}``."""
        epoch, _, number = cursor.partition(":")
        with self._lock:
            now = f"{self.epoch}:{self.number}"
            oldest = self._events[0][0] if self._events else self.number + 1
            seen = int(number) if epoch == self.epoch and number.isdigit() else -1
            if 0 <= seen <= self.number and seen + 1 >= oldest:
                return {"cursor": now, "events": [[kind, list(hashes)] for n, kind, hashes
                                                  in self._events if n > seen]}
        return {"cursor": now, "reset": self.held()}

    def answer(self, cursor: str) -> bytes:
        """:meth:`since`, signed (:func:`encode_events`)."""
        if not self.secret:
            raise ValueError("an event log without the cluster secret cannot sign")
        return encode_events(self.secret, self.since(cursor))


def encode_events(secret: bytes, answer: dict) -> bytes:
    body = json.dumps(answer).encode()
    return mac(secret, body) + body


def decode_events(secret: bytes, blob: bytes) -> dict:
    """A node's signed answer; raises Unauthenticated if the cluster secret did not sign it."""
    signature, body = blob[:MAC_BYTES], blob[MAC_BYTES:]
    if len(blob) < MAC_BYTES or not hmac.compare_digest(mac(secret, body), signature):
        raise Unauthenticated("KV events not signed with the cluster secret")
    return json.loads(body)
