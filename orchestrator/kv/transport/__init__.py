"""Transports behind one interface: ``local`` (in-process) and ``nixl`` (UCX)."""
