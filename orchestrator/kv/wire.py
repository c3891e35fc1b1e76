"""The checked header that travels with every KV block, and the signed ticket.

A block's header rides in the transport notification of the transfer that
carries its payload, so it arrives after the payload has landed. It says what
the payload is (request, layer range, heads, head size, dtype, positions, byte
count, optional CRC32 of the payload) and ends with a MAC over everything before
it, keyed by the cluster's shared secret: a receiver accepts a block only from a
peer that holds the secret. With the checksum on, the CRC
inside the authenticated header also binds the payload bytes.

A *ticket* is what a decode node hands a prefill node (through the
orchestrator) to say where to write: its transport endpoint, the slot address,
its layer range and layout. It is signed the same way.
"""

from __future__ import annotations

import base64
import enum
import hmac
import json
import struct
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from orchestrator.control.auth import MAC_BYTES, mac
from orchestrator.kv.errors import KVTransferError
from orchestrator.layout import DTYPE_BYTES, KVLayout

MAGIC = b"DJKV"
VERSION = 2  # 2: a LAYERS block names its positions (a prompt's layer goes in parts)
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_BYTES)}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_HAS_CRC = 1
# magic, version, kind, flags, first_layer, num_layers, num_heads, head_dim, dtype,
# seq_len, payload_bytes, crc32, batch, total_layers, len(request_id), len(extra),
# first_position, end_position
_FIXED = struct.Struct("!4sHBBIIIIBIQIIIHIII")


class BlockKind(enum.IntEnum):
    LAYERS = 1  # a prompt's KV for a layer range
    FINISH = 2  # a prefill stage is done; ``extra`` carries e.g. the first token
    DELTA = 3  # one token step of a batch (position ``seq_len``)
    ABORT = 4  # a prefill stage gave up: it writes nothing more of its layers (sent once
    # every transfer it posted is done, so a slot they all missed can be reused at once)
    CLAIM = 5  # a prefill node took the request: the token stage knows its writer before
    # any layer lands (a writer that ends frees the slot at once, not after a late-write wait)


@dataclass(frozen=True)
class BlockHeader:
    kind: BlockKind
    request_id: str
    first_layer: int
    num_layers: int
    num_heads: int
    head_dim: int
    dtype: str
    seq_len: int  # positions sent (LAYERS, FINISH) or the step's position (DELTA)
    payload_bytes: int
    crc32: int | None = None
    batch: int = 1
    total_layers: int = 0  # FINISH: the model's layer count
    extra: bytes = b""
    # LAYERS: the prompt positions [first_position, end_position) the payload holds (a
    # layer's KV may come in parts: positions cached at the sender go ahead of the rest)
    first_position: int = 0
    end_position: int = 0

    @property
    def layer_range(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def positions(self) -> range:
        return range(self.first_position, self.end_position)

    @classmethod
    def for_layout(cls, kind: BlockKind, request_id: str, layout: KVLayout, **fields):
        return cls(
            kind,
            request_id,
            layout.first_layer,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
            **fields,
        )


def encode_header(header: BlockHeader, secret: bytes) -> bytes:
    rid = header.request_id.encode()
    body = (
        _FIXED.pack(
            MAGIC,
            VERSION,
            header.kind,
            _HAS_CRC if header.crc32 is not None else 0,
            header.first_layer,
            header.num_layers,
            header.num_heads,
            header.head_dim,
            _DTYPE_CODES[header.dtype],
            header.seq_len,
            header.payload_bytes,
            header.crc32 or 0,
            header.batch,
            header.total_layers,
            len(rid),
            len(header.extra),
            header.first_position,
            header.end_position,
        )
        + rid
        + header.extra
    )
    return body + mac(secret, body)


def peek_request_id(data: bytes) -> str | None:
    """The request id a message claims, before it is authenticated (to fail that request)."""
    if len(data) < _FIXED.size or data[:4] != MAGIC:
        return None
    rid_len = _FIXED.unpack_from(data)[14]
    return data[_FIXED.size : _FIXED.size + rid_len].decode(errors="replace")


def decode_header(data: bytes, secret: bytes, peer: str) -> BlockHeader:
    """Parse and authenticate; raises :class:`KVTransferError` naming ``peer``."""
    if len(data) < _FIXED.size + MAC_BYTES or data[:4] != MAGIC:
        raise KVTransferError(peer, f"not a KV block header ({len(data)} bytes)")
    fields = _FIXED.unpack_from(data)
    _, version, kind, flags, *_, rid_len, extra_len, first_position, end_position = fields
    rid_at = _FIXED.size
    rid = data[rid_at : rid_at + rid_len].decode(errors="replace")
    if version != VERSION:
        raise KVTransferError(peer, f"wire version {version}, expected {VERSION}", rid)
    body_len = rid_at + rid_len + extra_len
    if len(data) != body_len + MAC_BYTES:
        raise KVTransferError(peer, f"malformed header: {len(data)} bytes for {body_len}", rid)
    if not hmac.compare_digest(data[body_len:], mac(secret, data[:body_len])):
        raise KVTransferError(peer, "bad secret: header MAC does not verify", rid)
    (_, _, _, _, first, count, heads, head_dim, dtype, seq_len, nbytes, crc, batch, total,
     *_) = fields
    if dtype not in _DTYPE_NAMES or kind not in set(BlockKind):
        raise KVTransferError(peer, f"unknown dtype code {dtype} or block kind {kind}", rid)
    return BlockHeader(
        BlockKind(kind),
        rid,
        first,
        count,
        heads,
        head_dim,
        _DTYPE_NAMES[dtype],
        seq_len,
        nbytes,
        crc if flags & _HAS_CRC else None,
        batch,
        total,
        data[rid_at + rid_len : body_len],
        first_position,
        end_position,
    )


def check_shape(header: BlockHeader, layout: KVLayout, peer: str) -> None:
    """The block's heads, head size, dtype and layers fit this node's layout."""
    rid = header.request_id
    for field, got, want in (
        ("KV heads", header.num_heads, layout.num_kv_heads),
        ("head size", header.head_dim, layout.head_dim),
        ("dtype", header.dtype, layout.dtype),
    ):
        if got != want:
            raise KVTransferError(peer, f"{field} mismatch: sender has {got}, receiver {want}", rid)
    ours, theirs = layout.layer_range, header.layer_range
    if not theirs or theirs.start < ours.start or theirs.stop > ours.stop:
        raise KVTransferError(
            peer,
            f"layers mismatch: block has layers [{theirs.start}, {theirs.stop}), "
            f"receiver holds [{ours.start}, {ours.stop})",
            rid,
        )


def layout_mismatch(theirs: KVLayout, ours: KVLayout, fields: tuple[str, ...]) -> str | None:
    """``"<field> mismatch: theirs X, ours Y"`` for the first differing field, else None."""
    for name in fields:
        got, want = getattr(theirs, name), getattr(ours, name)
        if got != want:
            return f"{name} mismatch: {got} vs {want}"
    return None


def check_payload(header: BlockHeader, expected_bytes: int, peer: str) -> None:
    if header.payload_bytes < expected_bytes:
        what = "truncated"
    elif header.payload_bytes > expected_bytes:
        what = "oversized"
    else:
        return
    raise KVTransferError(
        peer,
        f"{what} payload: {header.payload_bytes} bytes, expected {expected_bytes}",
        header.request_id,
    )


def crc32_of(pieces: Iterable[torch.Tensor]) -> int:
    """CRC32 over the bytes of ``pieces`` in order (each piece contiguous)."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece.contiguous().view(torch.uint8).numpy(), crc)
    return crc


@dataclass(frozen=True)
class Ticket:
    """Where a prefill node writes one request's KV on one decode node."""

    request_id: str
    node: str  # the receiver's transport name
    metadata: bytes  # the receiver's transport metadata
    slot_addr: int  # address of the request's slot in the receiver's registered pool
    layout: KVLayout  # the receiver's stage layout
    prompt_len: int
    checksum: bool  # the receiver requires a payload CRC
    # Token-step deltas land contiguously in ``landing_depth`` blocks at
    # ``landing_addr`` (step p in block p % depth); the receiver scatters them
    # into the slot and publishes how many positions it holds at ``consumed_addr``.
    landing_addr: int = 0
    landing_depth: int = 0
    consumed_addr: int = 0
    expires: float = 0.0  # Unix time after which no sender may write with it; 0: never
    # Positions [0, held) the receiver already holds (its decode-side prefix cache): the
    # sender writes only the positions from ``held`` on.
    held: int = 0

    @property
    def expired(self) -> bool:
        return bool(self.expires) and time.time() > self.expires

    def encode(self, secret: bytes) -> bytes:
        body = json.dumps(
            {
                "request_id": self.request_id,
                "node": self.node,
                "metadata": base64.b64encode(self.metadata).decode(),
                "slot_addr": self.slot_addr,
                "layout": self.layout.to_dict(),
                "prompt_len": self.prompt_len,
                "checksum": self.checksum,
                "landing": [self.landing_addr, self.landing_depth, self.consumed_addr],
                "expires": self.expires,
                "held": self.held,
            }
        ).encode()
        return body + mac(secret, body)

    @classmethod
    def decode(cls, data: bytes, secret: bytes) -> Ticket:
        body = data[:-MAC_BYTES]
        try:
            fields = json.loads(body)
            node = str(fields["node"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferError("?", f"malformed ticket ({len(data)} bytes)") from exc
        rid = fields.get("request_id")
        if not hmac.compare_digest(data[-MAC_BYTES:], mac(secret, body)):
            raise KVTransferError(node, "bad secret: ticket MAC does not verify", rid)
        return cls(
            rid,
            node,
            base64.b64decode(fields["metadata"]),
            int(fields["slot_addr"]),
            KVLayout(**fields["layout"]),
            int(fields["prompt_len"]),
            bool(fields["checksum"]),
            *(int(v) for v in fields["landing"]),
            float(fields["expires"]),
            int(fields.get("held", 0)),
        )
