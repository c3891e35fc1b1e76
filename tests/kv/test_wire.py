"""Block headers and tickets: round trips, and every rejection names what was wrong."""

from __future__ import annotations

import pytest
import torch

from orchestrator.kv.errors import KVTransferError
from orchestrator.kv.wire import (
    BlockHeader,
    BlockKind,
    Ticket,
    check_payload,
    check_shape,
    crc32_of,
    decode_header,
    encode_header,
    peek_request_id,
)
from orchestrator.layout import KVLayout

SECRET = b"cluster-secret"
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, max_seq_len=32, first_layer=4)


def header(**changes) -> BlockHeader:
    fields = dict(seq_len=10, payload_bytes=1280, crc32=0xDEADBEEF, extra=b"tok",
                  first_position=2, end_position=10)
    fields.update(changes)
    return BlockHeader.for_layout(BlockKind.LAYERS, "req-1", LAYOUT.layers(5, 2), **fields)


def test_header_round_trip() -> None:
    h = header()
    assert decode_header(encode_header(h, SECRET), SECRET, "p0") == h
    no_crc = header(crc32=None)
    assert decode_header(encode_header(no_crc, SECRET), SECRET, "p0").crc32 is None


def test_wrong_secret_is_rejected_naming_peer() -> None:
    data = encode_header(header(), SECRET)
    with pytest.raises(KVTransferError, match="bad secret") as info:
        decode_header(data, b"other-secret", "p0")
    assert info.value.peer == "p0" and info.value.request_id == "req-1"
    assert peek_request_id(data) == "req-1"


@pytest.mark.parametrize("index", [6, 20, 40])  # fixed fields, layer/seq fields, request id
def test_any_flipped_byte_breaks_the_mac(index: int) -> None:
    data = bytearray(encode_header(header(), SECRET))
    data[index] ^= 0x01
    with pytest.raises(KVTransferError):
        decode_header(bytes(data), SECRET, "p0")


def test_garbage_and_truncated_headers() -> None:
    with pytest.raises(KVTransferError, match="not a KV block header"):
        decode_header(b"hello", SECRET, "p0")
    data = encode_header(header(), SECRET)
    with pytest.raises(KVTransferError, match="malformed header"):
        decode_header(data[:-1], SECRET, "p0")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", 3, "KV heads mismatch: sender has 3, receiver 2"),
        ("head_dim", 16, "head size mismatch: sender has 16, receiver 8"),
        ("dtype", "float16", "dtype mismatch: sender has float16, receiver float32"),
        ("first_layer", 2, r"layers mismatch: block has layers \[2, 4\), receiver holds \[4, 8\)"),
        ("num_layers", 5, r"layers mismatch: block has layers \[5, 10\)"),
    ],
)
def test_shape_mismatch_names_the_field(field: str, value, message: str) -> None:
    bad = BlockHeader(**{**header().__dict__, field: value})
    with pytest.raises(KVTransferError, match=message):
        check_shape(bad, LAYOUT, "p0")


def test_payload_size_checks() -> None:
    check_payload(header(payload_bytes=100), 100, "p0")
    with pytest.raises(KVTransferError, match="truncated payload: 99 bytes, expected 100"):
        check_payload(header(payload_bytes=99), 100, "p0")
    with pytest.raises(KVTransferError, match="oversized payload: 101 bytes, expected 100"):
        check_payload(header(payload_bytes=101), 100, "p0")


def test_crc_over_pieces_equals_crc_over_concatenation() -> None:
    a, b = torch.randn(5), torch.randn(7)
    assert crc32_of([a, b]) == crc32_of([torch.cat([a, b])])
    assert crc32_of([a.half()]) != crc32_of([a])


def test_ticket_round_trip_and_secret() -> None:
    ticket = Ticket("req-1", "t0", b"\x00md\xff", 0x7F00_0000_1000, LAYOUT, 17, True)
    data = ticket.encode(SECRET)
    assert Ticket.decode(data, SECRET) == ticket
    with pytest.raises(KVTransferError, match="bad secret: ticket") as info:
        Ticket.decode(data, b"nope")
    assert info.value.peer == "t0"
    with pytest.raises(KVTransferError, match="malformed ticket"):
        Ticket.decode(b"x" * 40, SECRET)
