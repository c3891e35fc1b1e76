"""What a node counts: requests by outcome, queue length, KV streamed, resources held,
reruns.

The serving library reports through this interface; inside Triton,
:class:`orchestrator.serving.pb.TritonMetrics` publishes it on the server's
Prometheus port. The base class drops everything (unit tests, no Triton).
"""

from __future__ import annotations


class Metrics:
    def request_done(self, outcome: str) -> None:
        """``outcome``: finished, cancelled, refused or failed."""

    def queue_length(self, requests: int) -> None:
        """Requests the node holds right now (running or waiting)."""

    def kv_streamed(self, nbytes: int, seconds: float) -> None:
        """One prompt's KV: bytes moved and how long its transfer was open."""

    def held(self, what: str, count: int) -> None:
        """Request resources taken right now (``what``: staging_blocks, ...): 0 when idle."""

    def rerun(self, what: str) -> None:
        """The frontend ran a ``prompt`` again on another P-node, or a whole ``request``
        again from its prompt (its pipeline lost it)."""
