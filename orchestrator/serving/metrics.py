"""What a node counts: requests by outcome, queue length, KV streamed, resources held,
reruns.

The serving library reports through this interface; inside Triton,
:class:`orchestrator.serving.pb.TritonMetrics` publishes it on the server's
Prometheus port. The base class drops everything (unit tests, no Triton).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.kv.prefix_cache import PrefixCache

log = logging.getLogger("dejavu.metrics")

# A series: (what is counted, its label's value or "")
Series = tuple[str, str]


class Metrics:
    def request_done(self, outcome: str) -> None:
        """``outcome``: finished, cancelled, refused or failed."""

    def queue_length(self, requests: int) -> None:
        """Requests the node holds right now (running or waiting)."""

    def kv_streamed(self, nbytes: int, seconds: float, ahead: int = 0) -> None:
        """One prompt's KV: bytes moved and how long its transfer was open; ``ahead`` of
        those bytes, a P-node's cached positions, sent before the rest was computed."""

    def kv_reused(self, nbytes: int) -> None:
        """Prompt KV a T-node already held (decode-side reuse): not streamed to it."""

    def held(self, what: str, count: int) -> None:
        """Request resources taken right now (``what``: staging_blocks, ...): 0 when idle."""

    def rerun(self, what: str) -> None:
        """The frontend ran a ``prompt`` again on another P-node, or a whole ``request``
        again from its prompt (its pipeline lost it)."""

    def reattached(self) -> None:
        """The frontend re-attached a request whose head was lost to the new head, with the
        tokens it had delivered: the request went on from the KV kept, not its prompt."""

    def prefix_cache(self, cache: PrefixCache) -> None:
        """The node's prefix cache after a prefill: its counters since start, its bytes."""

    def leg(self, what: str, seconds: float) -> None:
        """The frontend's wait on one leg of a disaggregated request's way to its first
        token (``what``: ``admission``, the T-node's KV ticket; ``prefill_call``, the
        P-node's answer, its queue and prefill included)."""


class PublishedMetrics(Metrics):
    """Metrics that one background thread publishes, coalesced: counters add up, gauges keep
    their latest value. Inside Triton a metric update is an IPC round trip to tritonserver
    that holds the GIL (~0.4 ms here): made by the caller, it stalled the token loop at every
    request's start and end, and a prefill's answer six times. A reader may see an update a
    moment late."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: dict[Series, float] = {}
        self._gauges: dict[Series, float] = {}
        self._due = threading.Event()
        threading.Thread(target=self._run, name="metrics", daemon=True).start()

    def publish(self, added: dict[Series, float], gauges: dict[Series, float]) -> None:
        """Apply what was counted since the last call (counter increments, gauge values)."""
        raise NotImplementedError

    def request_done(self, outcome: str) -> None:
        self._add({("requests", outcome): 1})

    def rerun(self, what: str) -> None:
        self._add({("reruns", what): 1})

    def reattached(self) -> None:
        self._add({("reattached", ""): 1})

    def queue_length(self, requests: int) -> None:
        self._set(("queue_length", ""), requests)

    def kv_streamed(self, nbytes: int, seconds: float, ahead: int = 0) -> None:
        self._add({("kv_bytes", ""): nbytes, ("kv_seconds", ""): seconds,
                   ("kv_ahead_bytes", ""): ahead})

    def kv_reused(self, nbytes: int) -> None:
        self._add({("kv_reused_bytes", ""): nbytes})

    def held(self, what: str, count: int) -> None:
        self._set(("held", what), count)

    def prefix_cache(self, cache: PrefixCache) -> None:
        stats = cache.stats
        for what, value in (("lookup_tokens", stats.lookup_tokens),
                            ("hit_tokens", stats.hit_tokens),
                            ("evicted_blocks", stats.evicted_blocks),
                            ("hit_rate", stats.hit_rate), ("bytes", cache.used_bytes),
                            ("budget_bytes", cache.budget_bytes)):
            self._set(("prefix_cache", what), value)

    def leg(self, what: str, seconds: float) -> None:
        self._add({("leg_seconds", what): seconds, ("legs", what): 1})

    def _add(self, amounts: dict[Series, float]) -> None:
        """Counter increments, published together."""
        with self._lock:
            for series, amount in amounts.items():
                self._added[series] = self._added.get(series, 0) + amount
        self._due.set()

    def _set(self, series: Series, value: float) -> None:
        with self._lock:
            self._gauges[series] = value
        self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            with self._lock:
                added, gauges = self._added, self._gauges
                self._added, self._gauges = {}, {}
            try:
                self.publish(added, gauges)
            except Exception:  # a metric is never worth a node
                log.exception("could not publish metrics")
