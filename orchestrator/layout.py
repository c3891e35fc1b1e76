"""The shapes the engine and the KV library agree on: a stage's layer range and its KV slots.

A leaf module (it imports neither ``engine`` nor ``kv``), so the two packages
never import each other: :class:`StageSpec` is which layers a stage holds,
:class:`KVLayout` / :class:`KVCache` how their KV is laid out.

One sequence owns one *slot*: a tensor shaped
``[num_layers, 2 (K/V), num_kv_heads, max_seq_len, head_dim]`` for the layers
its node holds. A prompt's KV of one layer is then one strided block, and a
token step touches ``num_layers * 2 * num_kv_heads`` small slices of
``head_dim`` elements each: the non-contiguous delta that buffered copies
gather into one transfer (DejaVu §4.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The dtypes a model and its KV may take, by name; torch is imported only where tensors are
# made, so a frontend that tokenizes and routes never loads it.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


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
        return torch_dtype(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.max_seq_len, self.head_dim)

    @property
    def layer_range(self) -> range:
        """Global indices of this node's layers."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

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
        import torch

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


@dataclass(frozen=True)
class StageSpec:
    """Layers ``[first_layer, last_layer)`` of a model with ``num_layers`` layers."""

    first_layer: int
    last_layer: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.first_layer < self.last_layer <= self.num_layers:
            raise ValueError(
                f"bad stage [{self.first_layer}, {self.last_layer}) of {self.num_layers} layers"
            )

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.num_layers

    @property
    def count(self) -> int:
        return self.last_layer - self.first_layer

    @classmethod
    def whole(cls, num_layers: int) -> StageSpec:
        return cls(0, num_layers, num_layers)

    @classmethod
    def split(
        cls, num_layers: int, depth: int, layers: Sequence[int] | None = None
    ) -> list[StageSpec]:
        """Split evenly (earlier stages take the remainder), or by explicit layer counts."""
        if layers is not None:
            if depth != len(layers):
                raise ValueError(f"depth {depth} but {len(layers)} layer counts {list(layers)}")
            if sum(layers) != num_layers or min(layers) < 1:
                raise ValueError(f"layer counts {list(layers)} do not split {num_layers} layers")
            return [cls(a, b, num_layers) for a, b in pairwise([0, *accumulate(layers)])]
        if not 1 <= depth <= num_layers:
            raise ValueError(f"cannot split {num_layers} layers into {depth} stages")
        base, extra = divmod(num_layers, depth)
        stages, first = [], 0
        for i in range(depth):
            n = base + (1 if i < extra else 0)
            stages.append(cls(first, first + n, num_layers))
            first += n
        return stages
