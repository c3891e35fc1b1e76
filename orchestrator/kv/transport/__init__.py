"""Transports behind one interface: ``local`` (in-process) and ``nixl`` (UCX)."""

from orchestrator.kv.transport.base import KVPoll, Region, TransferHandle, Transport

__all__ = ["KVPoll", "Region", "TransferHandle", "Transport"]
