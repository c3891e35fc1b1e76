"""The KV-cache layout every part of the system agrees on.

One sequence owns one *slot*: a tensor shaped
``[num_layers, 2 (K/V), num_kv_heads, max_seq_len, head_dim]`` for the layers
its node holds. A prompt's KV of one layer is then one strided block, and a
token step touches ``num_layers * 2 * num_kv_heads`` small slices of
``head_dim`` elements each: the non-contiguous delta that buffered copies
gather into one transfer (DejaVu §4.1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one sequence's KV slot on one node (a contiguous layer range)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str = "float32"
    first_layer: int = 0  # global index of this node's first layer

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.max_seq_len, self.head_dim)

    @property
    def layer_range(self) -> range:
        """Global indices of this node's layers."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def token_bytes_per_layer(self) -> int:
        """Bytes one position adds to one layer (K and V, all heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def step_bytes(self) -> int:
        """Bytes one token step adds to one sequence's slot (all layers)."""
        return self.num_layers * self.token_bytes_per_layer()

    def slot_bytes(self) -> int:
        return self.num_layers * self.max_seq_len * self.token_bytes_per_layer()

    def layers(self, first: int, count: int) -> KVLayout:
        """The layout of a sub-range of this node's layers (global ``first``)."""
        if first < self.first_layer or first + count > self.first_layer + self.num_layers:
            raise ValueError(
                f"layers [{first}, {first + count}) outside "
                f"[{self.first_layer}, {self.first_layer + self.num_layers})"
            )
        return KVLayout(
            count, self.num_kv_heads, self.head_dim, self.max_seq_len, self.dtype, first
        )

    def allocate(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class KVCache:
    """One sequence's KV slot plus how many positions are filled."""

    layout: KVLayout
    data: torch.Tensor  # layout.shape
    length: int = 0

    @classmethod
    def empty(cls, layout: KVLayout, device: str | torch.device = "cpu") -> KVCache:
        return cls(layout, layout.allocate(device), 0)

    def layer(self, global_layer: int) -> torch.Tensor:
        """``[2, heads, max_seq, head_dim]`` view of one layer by global index."""
        return self.data[global_layer - self.layout.first_layer]
