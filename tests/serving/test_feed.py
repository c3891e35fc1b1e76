"""Token feeds between a sender and a listener in this process, over loopback TCP: rows arrive
in order, a forged, replayed or unsubscribed message is refused, and a dropped connection
is told to the feed's subscriber."""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.serving.feed import FeedListener, FeedSender, encode_rows, frame

SECRET = b"feed-test-secret"


@pytest.fixture
def listener():
    listener = FeedListener(SECRET, "127.0.0.1")
    yield listener
    listener.close()


def subscribe(listener: FeedListener, feed_id: str) -> tuple[queue.Queue, threading.Event]:
    got, lost = queue.Queue(), threading.Event()
    listener.subscribe(feed_id, got.put, lost.set)
    return got, lost


def test_rows_arrive_in_order_and_a_dropped_connection_is_told(listener):
    got, lost = subscribe(listener, "f1")
    sender = FeedSender(listener.address, "f1", SECRET)
    probs = [TokenLogProb(-0.5, ((3, -0.5), (4, -1.25)))]
    sender.send([("a", [1, 2], None, False), ("b", [3], probs, False)])
    sender.send([("a", [5], None, True)])
    assert got.get(timeout=5) == [("a", [1, 2], None, False), ("b", [3], probs, False)]
    assert got.get(timeout=5) == [("a", [5], None, True)]
    assert not lost.is_set()
    sender.close()  # the T-node went away mid-feed
    assert lost.wait(5)
    sender.send([("a", [6], None, False)])  # a closed feed sends nothing, and does not raise


def test_forged_replayed_and_unknown_messages_are_refused(listener):
    """All on one connection, so in order: only the genuine ones come through."""
    got, _ = subscribe(listener, "f1")
    host, port = listener.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), 5.0)

    def message(n: int, token: int, feed: bytes = b"f1", secret: bytes = SECRET) -> bytes:
        return frame(secret, feed, n, encode_rows([("a", [token], None, False)]))

    try:
        raw.sendall(message(1, 666, secret=b"not-the-cluster-secret"))  # forged
        raw.sendall(message(1, 667, feed=b"nobody-listens"))  # no such feed here
        raw.sendall(message(1, 1))
        raw.sendall(message(1, 1))  # a replay
        raw.sendall(message(2, 2))
        assert got.get(timeout=5) == [("a", [1], None, False)]
        assert got.get(timeout=5) == [("a", [2], None, False)]
        assert got.empty()
    finally:
        raw.close()
