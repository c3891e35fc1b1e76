"""DejaVuLib's KV movement (DejaVu §4.1), as the P/T connector uses it.

- ``scatter``: a non-contiguous KV region (positions of some layers of a slot,
  as the contiguous runs :func:`kv_spans` lists) written from packed staging
  blocks in one transfer; :func:`pack` fills that block from a cache.
- ``stream_out``: which token stage each of a prompt stage's layers go to
  (split at the source when a prompt stage spans several token stages; a token
  stage that takes layers from several prompt stages is filled by each of them).

A contiguous block moves with the transport's own ``write`` / ``read``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.transport.base import Pair, Region, TransferHandle, Transport
from orchestrator.layout import KVCache, KVLayout

# -- non-contiguous KV regions ----------------------------------------------------


def kv_spans(layout: KVLayout, slot_addr: int, layers: range, positions: range) -> list[Region]:
    """The contiguous runs of ``positions`` of ``layers`` in a slot at ``slot_addr``.

    Ordered (layer, K/V, head), the order :func:`pack` lays them out in, so the
    runs pair one-to-one with consecutive pieces of a packed staging block.
    """
    if positions.step != 1 or not 0 <= positions.start < positions.stop <= layout.max_seq_len:
        raise ValueError(f"positions {positions} outside [0, {layout.max_seq_len})")
    layout.layers(layers.start, len(layers))  # validates the layer range
    row = layout.head_dim * layout.itemsize
    run = len(positions) * row
    spans = []
    for layer in layers:
        for kv_head in range(2 * layout.num_kv_heads):
            index = (layer - layout.first_layer) * 2 * layout.num_kv_heads + kv_head
            offset = (index * layout.max_seq_len + positions.start) * row
            spans.append(Region(slot_addr + offset, run))
    return spans


def pair_spans(local: Sequence[Region], remote: Sequence[Region]) -> list[Pair]:
    """Cut two span lists of equal total size into (local, remote) pieces of equal size."""
    if sum(r.nbytes for r in local) != sum(r.nbytes for r in remote):
        raise ValueError("local and remote spans differ in total size")
    pairs: list[Pair] = []
    i = j = li = rj = 0  # span indices and offsets into them
    while i < len(local) and j < len(remote):
        n = min(local[i].nbytes - li, remote[j].nbytes - rj)
        pairs.append((local[i].sub(li, n), remote[j].sub(rj, n)))
        li, rj = li + n, rj + n
        if li == local[i].nbytes:
            i, li = i + 1, 0
        if rj == remote[j].nbytes:
            j, rj = j + 1, 0
    return pairs


def scatter(
    transport: Transport,
    peer: str,
    local: Sequence[Region],
    remote_spans: Sequence[Region],
    notify: bytes = b"",
) -> TransferHandle:
    """Write packed local blocks (in order) into a non-contiguous remote region, as one
    transfer."""
    return transport.write(peer, pair_spans(local, remote_spans), notify)


def region_view(cache: KVCache, layers: range, positions: range) -> torch.Tensor:
    """``[layers, 2, heads, positions, head_dim]`` strided view of a cache."""
    first = layers.start - cache.layout.first_layer
    return cache.data[first : first + len(layers), :, :, positions.start : positions.stop]


def pack(cache: KVCache, layers: range, positions: range, out: torch.Tensor) -> torch.Tensor:
    """Copy a KV region into the front of a flat staging tensor; returns the packed view."""
    view = region_view(cache, layers, positions)
    packed = out.view(view.dtype)[: view.numel()].view(view.shape)
    packed.copy_(view)
    return packed


# -- pipeline regrouping ----------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Layers ``layers`` go from prompt stage ``src`` to token stage ``dst``."""

    src: int
    dst: int
    layers: range


def routes(src: Sequence[range], dst: Sequence[range]) -> list[Route]:
    """Every non-empty overlap of a source layer range with a destination range."""
    out = []
    for s, s_range in enumerate(src):
        for d, d_range in enumerate(dst):
            lo, hi = max(s_range.start, d_range.start), min(s_range.stop, d_range.stop)
            if lo < hi:
                out.append(Route(s, d, range(lo, hi)))
    return out


def stream_out(prompt_layers: range, token_stages: Sequence[range]) -> list[Route]:
    """Where a prompt stage holding ``prompt_layers`` sends them (split at the source)."""
    return routes([prompt_layers], token_stages)
