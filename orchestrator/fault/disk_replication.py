"""KV replicas on the stage's own local disk: the paper's SSD variant.

Each step's KV delta goes into one file per sequence in ``folder`` (memory
mapped: a write is a copy into the page cache, so a killed process loses
nothing; a machine that crashes loses what the kernel had not written yet).
The stage acks its own steps ``(x, j, t)`` once written. A stage started again
on the same machine reads its predecessor's files back: recovery step 1
without the network, and nothing goes to the next stage, so host memory holds
no replicas at all. The price: a node lost with its disk has no replica.

Same calls as :class:`~orchestrator.fault.node_replication.NodeReplication`,
so :class:`~orchestrator.fault.stage_recovery.RecoveryOps` drives either;
the calls that move replicas between stages do nothing here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.fault.replication import AckFn
from orchestrator.layout import KVCache
from orchestrator.pipeline.node import StageNode


class DiskReplication:
    def __init__(self, node: StageNode, folder: str | Path, *, ack: AckFn | None = None) -> None:
        self.node, self.folder, self.ack = node, Path(folder), ack
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, torch.Tensor] = {}  # seq id -> its mapped KV slot
        self._written: dict[int, int] = {}  # seq id -> positions on disk

    def endpoints(self) -> bytes:
        return json.dumps({"stage": self.node.index, "folder": str(self.folder)}).encode()

    def connect(self, next: bytes, previous: bytes) -> None:  # noqa: A002, ARG002
        """Plug into the stage worker's hooks (after ``node.connect``)."""
        worker = self.node.worker
        if worker is None:
            raise RuntimeError(f"stage {self.node.index}: node.connect() before replicating")
        worker.on_step, worker.on_release = self._on_step, self._on_release

    def reconnect(self, next: bytes) -> None:  # noqa: A002, ARG002
        """Nothing to do: replicas do not cross to the next stage."""

    def restore(self, to: bytes, lengths: dict[str, int]) -> None:  # noqa: ARG002
        """Nothing to send: the replacement reads its own files (:meth:`adopt`)."""

    def adopt(self, lengths: dict[str, int],
              sampling: dict[int, SamplingParams] | None = None) -> None:
        """On the replacement, before it starts: read the lost stage's KV back from disk."""
        worker = self.node.worker
        assert worker is not None
        for path in self.folder.glob("*.kv"):
            if path.stem not in lengths:  # ended, or redone from its prompt
                path.unlink()
        for rid, length in lengths.items():
            seq_id = int(rid)
            cache = self.node.engine.new_cache()
            cache.data[:, :, :, :length].copy_(self._file(seq_id)[:, :, :, :length])
            cache.length = self._written[seq_id] = length
            self.node.kv.add(seq_id, cache)
        if worker.is_last:
            worker.samplers.update({s: Sampler(p) for s, p in (sampling or {}).items()})

    def rollback(self, lengths: dict[int, int]) -> None:
        """Recovery step 4 on a surviving stage: cut its KV (and its files) back."""
        self.node.kv.rollback(lengths)
        for seq_id in list(self._files):
            if seq_id in lengths:
                self._written[seq_id] = min(self._written[seq_id], lengths[seq_id])
            else:
                self._remove(seq_id)

    def reseed(self) -> None:
        """Nothing to do: the files already hold what the stage kept."""

    def replica_lengths(self) -> dict[str, int]:
        """None held for another stage: a lost stage 0's sequences are not re-attached."""
        return {}

    def held(self) -> list[str]:
        """Sequences with a replica file (as strings)."""
        return sorted(p.stem for p in self.folder.glob("*.kv"))

    def held_counts(self) -> dict[str, int]:
        return {"replicas": len(self.held()), "landing": 0}

    def close(self) -> None:
        """The files stay: a stage started again reads them."""
        self._files.clear()

    def _on_step(self, microbatch: int, step: int, seq_ids: list[int],
                 caches: list[KVCache]) -> None:
        for seq_id, cache in zip(seq_ids, caches, strict=True):
            start = self._written.get(seq_id, 0)
            self._file(seq_id)[:, :, :, start:cache.length].copy_(
                cache.data[:, :, :, start:cache.length])
            self._written[seq_id] = cache.length
        if self.ack is not None:
            self.ack(self.node.index, microbatch, step)

    def _on_release(self, seq_id: int) -> None:
        self._remove(seq_id)

    def _file(self, seq_id: int) -> torch.Tensor:
        if seq_id not in self._files:
            layout = self.node.engine.kv_layout
            numel = layout.slot_bytes() // layout.torch_dtype.itemsize
            path = self.folder / f"{seq_id}.kv"
            self._files[seq_id] = torch.from_file(str(path), shared=True, size=numel,
                                                  dtype=layout.torch_dtype).view(layout.shape)
        return self._files[seq_id]

    def _remove(self, seq_id: int) -> None:
        self._files.pop(seq_id, None)
        self._written.pop(seq_id, None)
        (self.folder / f"{seq_id}.kv").unlink(missing_ok=True)
