"""The devices a node runs on: a set of CPU cores, or CUDA GPUs.

Written ``cpu:0-1,3`` or ``cuda:0`` (bare ids mean CPU cores). On CPU the
tritonserver is pinned to its cores before it executes, so its Python-backend
stubs (its children) inherit the mask, and the models set torch's thread count
to the number of cores; on GPU the node sees only its GPUs through
``CUDA_VISIBLE_DEVICES``. A node without devices runs where the OS puts it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Devices:
    kind: str  # cpu | cuda
    ids: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Devices:
        kind, _, ids = text.strip().rpartition(":")
        kind = kind or "cpu"
        if kind not in KINDS:
            raise ValueError(f"device kind must be one of {KINDS}, got {kind!r} in {text!r}")
        try:
            numbers = sorted({i for part in ids.split(",") for i in _span(part)})
        except ValueError:
            raise ValueError(f"bad devices {text!r}: want e.g. cpu:0-1,3 or cuda:0") from None
        if not numbers or numbers[0] < 0:
            raise ValueError(f"bad devices {text!r}: want e.g. cpu:0-1,3 or cuda:0")
        if kind == "cpu":
            usable = os.sched_getaffinity(0)
            if not set(numbers) <= usable:
                raise ValueError(f"cores {sorted(set(numbers) - usable)} of {text!r} are not "
                                 f"available (this process may use {sorted(usable)})")
        return cls(kind, tuple(numbers))

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(map(str, self.ids))}"

    @property
    def threads(self) -> int | None:
        """torch's intra-op threads on these devices (None: GPU, leave it)."""
        return len(self.ids) if self.kind == "cpu" else None

    def environment(self) -> dict[str, str]:
        if self.kind == "cuda":
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.ids))}
        return {"OMP_NUM_THREADS": str(len(self.ids))}

    def pin(self) -> None:
        """Run in the child between fork and exec: everything it starts inherits the mask."""
        if self.kind == "cpu":
            os.sched_setaffinity(0, self.ids)


def _span(part: str) -> range:
    low, _, high = part.partition("-")
    return range(int(low), int(high or low) + 1)


def parse_assignments(items: list[str]) -> dict[str, Devices]:
    """``NAME=DEVICES`` items (``prefill0=cpu:0 decode0=cpu:1``) as {node name: Devices}."""
    out = {}
    for item in items:
        name, sep, devices = item.partition("=")
        if not sep or not name:
            raise ValueError(f"bad --devices item {item!r}: want NODE=DEVICES, e.g. "
                             "decode0=cpu:1")
        out[name.strip()] = Devices.parse(devices)
    return out


def node_devices(devices: str) -> Devices | None:
    """The devices a node's configuration names (None: not pinned)."""
    return Devices.parse(devices) if devices else None
