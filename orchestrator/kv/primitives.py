"""DejaVuLib's three levels of KV movement (DejaVu §4.1).

1. ``flush`` / ``fetch``: one contiguous block to / from a peer (or this node,
   through the transport's loopback).
2. ``scatter`` / ``gather``: a non-contiguous KV region (positions of some
   layers of a slot) as the contiguous runs a transport can move, paired with a
   contiguous staging block on the other side; ``pack`` / ``unpack`` do the
   same between a cache tensor and a staging tensor in memory.
3. ``stream_out`` / ``stream_in``: given the pipeline configuration, which
   token stage each prompt stage's layers go to (split at the source when a
   prompt stage spans several token stages, merged at the destination when a
   token stage takes layers from several prompt stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.kv.transport.base import Pair, Region, TransferHandle, Transport
from orchestrator.layout import KVCache, KVLayout, StageSpec

# -- level 1: contiguous blocks ----------------------------------------------------------


def flush(
    transport: Transport, peer: str, local: Region, remote: Region, notify: bytes = b""
) -> TransferHandle:
    """Copy a local contiguous block to ``remote`` on ``peer``."""
    return transport.write(peer, [(local, remote)], notify)


def fetch(
    transport: Transport, peer: str, local: Region, remote: Region, notify: bytes = b""
) -> TransferHandle:
    """Copy ``remote`` on ``peer`` into a local contiguous block."""
    return transport.read(peer, [(local, remote)], notify)


# -- level 2: non-contiguous KV regions ----------------------------------------------------


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
    local: Region,
    remote_spans: Sequence[Region],
    notify: bytes = b"",
) -> TransferHandle:
    """Write a packed local block into a non-contiguous remote region, as one transfer."""
    return transport.write(peer, pair_spans([local], remote_spans), notify)


def gather(
    transport: Transport,
    peer: str,
    local: Region,
    remote_spans: Sequence[Region],
    notify: bytes = b"",
) -> TransferHandle:
    """Read a non-contiguous remote region into a packed local block, as one transfer."""
    return transport.read(peer, pair_spans([local], remote_spans), notify)


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


def unpack(packed: torch.Tensor, cache: KVCache, layers: range, positions: range) -> None:
    """Inverse of :func:`pack`."""
    view = region_view(cache, layers, positions)
    view.copy_(packed.view(view.dtype)[: view.numel()].view(view.shape))


# -- level 3: pipeline regrouping ----------------------------------------------------------


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


@dataclass(frozen=True)
class PipelineConfig:
    """Prompt and token pipelines over the same model."""

    num_layers: int
    prompt_depth: int
    token_depth: int

    def prompt_stages(self) -> list[range]:
        return _ranges(StageSpec.split(self.num_layers, self.prompt_depth))

    def token_stages(self) -> list[range]:
        return _ranges(StageSpec.split(self.num_layers, self.token_depth))


def _ranges(stages: Sequence[StageSpec]) -> list[range]:
    return [range(s.first_layer, s.last_layer) for s in stages]


def stream_out(config: PipelineConfig, prompt_stage: int) -> list[Route]:
    """Where prompt stage ``prompt_stage`` sends its layers (split at the source)."""
    all_routes = routes(config.prompt_stages(), config.token_stages())
    return [r for r in all_routes if r.src == prompt_stage]


def stream_in(config: PipelineConfig, token_stage: int) -> list[Route]:
    """Which prompt stages fill token stage ``token_stage`` (merged at the destination)."""
    all_routes = routes(config.prompt_stages(), config.token_stages())
    return [r for r in all_routes if r.dst == token_stage]
