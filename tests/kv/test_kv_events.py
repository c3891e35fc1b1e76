"""A node's KV events: numbered, read from a cursor, reset when the cursor is stale, signed."""

import pytest

from orchestrator.control.auth import Unauthenticated
from orchestrator.kv.events import KVEventLog, decode_events, encode_events
from orchestrator.kv.prefix_cache import KVEvent


def test_a_reader_gets_what_came_after_its_cursor_or_a_reset():
    held = [7, 8]
    log = KVEventLog(lambda: list(held), keep=2)
    first = log.since("")
    assert first["reset"] == [7, 8]  # a new reader: everything held
    log.record(KVEvent("stored", (9,)))
    second = log.since(first["cursor"])
    assert second["events"] == [["stored", [9]]]
    assert log.since(second["cursor"])["events"] == []
    log.record(KVEvent("removed", (7,)))
    log.record(KVEvent("stored", (10,)))
    log.record(KVEvent("stored", (11,)))  # the log keeps 2: the reader at 1 missed one
    assert "reset" in log.since(second["cursor"])
    assert "reset" in log.since(f"another-epoch:{log.number}")  # the node started again
    assert "reset" in log.since("garbage")


def test_events_are_signed_with_the_cluster_secret():
    log = KVEventLog(lambda: [5], b"secret")
    assert decode_events(b"secret", log.answer(""))["reset"] == [5]
    with pytest.raises(ValueError, match="cannot sign"):
        KVEventLog(list).answer("")
    blob = encode_events(b"secret", {"cursor": "e:1", "events": []})
    assert decode_events(b"secret", blob) == {"cursor": "e:1", "events": []}
    with pytest.raises(Unauthenticated):
        decode_events(b"other", blob)
    with pytest.raises(Unauthenticated):
        decode_events(b"secret", blob[:-1] + b" ")
