"""Join-the-shortest-queue routing by pending tokens (Splitwise §4.2).

A P-node's queue is the prompt tokens it still has to prefill; a T-node's is
the tokens its admitted requests may still generate, and colocated the prompt
tokens it has yet to prefill. A node that holds as many requests as it has
slots is passed over while another has room: a request sent there would only
wait for a slot, holding its seat (on the code trace, 6 P-nodes on 2 T-nodes
served 12% below the simulator while one T-node was full and the other half
empty). A node that failed is left out for ``down_s`` seconds so a dead node
with an empty queue does not attract every request.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Leads the message of a request that failed because no node could serve it (every one of a
# pool down, or still failing after the reruns): a decoupled model's error reaches a gRPC
# client as text only, so clients (the OpenAI API: HTTP 503) tell it apart by this.
UNAVAILABLE = "no node can serve the request"


class NoNodeError(RuntimeError):
    """Every node of a pool is down."""


class Router:
    def __init__(self, nodes: list[str], down_s: float = 5.0,
                 slots: dict[str, int] | None = None) -> None:
        """``slots``: the requests each node holds at once (none given: no bound)."""
        if not nodes:
            raise ValueError("a router needs at least one node")
        self.pending: dict[str, int] = dict.fromkeys(nodes, 0)
        self.held: dict[str, int] = dict.fromkeys(nodes, 0)  # requests routed, not yet left
        self.slots = slots or {}
        self.down_until: dict[str, float] = dict.fromkeys(nodes, 0.0)
        self.down_s = down_s
        self.revivals = 0  # nodes marked up while down: a request waiting to rerun goes now
        self.lock = threading.Lock()

    def pick(self, tokens: int) -> str:
        """The live node with the fewest pending tokens, among those with a free slot if
        any; ``tokens`` join its queue and the request holds it until :meth:`leave`."""
        now = time.monotonic()
        with self.lock:
            live = [n for n in self.pending if self.down_until[n] <= now]
            if not live:
                raise NoNodeError(f"all nodes down: {', '.join(self.pending)}")
            free = [n for n in live if self.held[n] < self.slots.get(n, math.inf)]
            node = min(free or live, key=lambda n: self.pending[n])
            self.pending[node] += tokens
            self.held[node] += 1
            return node

    def done(self, node: str, tokens: int) -> None:
        with self.lock:
            self.pending[node] = max(0, self.pending[node] - tokens)

    def leave(self, node: str) -> None:
        """A request picked for ``node`` is done with it."""
        with self.lock:
            self.held[node] = max(0, self.held[node] - 1)

    def mark_down(self, node: str) -> None:
        with self.lock:
            self.down_until[node] = time.monotonic() + self.down_s

    def mark_up(self, node: str) -> None:
        with self.lock:
            if self.down_until[node] > time.monotonic():
                self.revivals += 1
            self.down_until[node] = 0.0

    @contextmanager
    def assign(self, tokens: int) -> Iterator[str]:
        node = self.pick(tokens)
        try:
            yield node
        finally:
            self.done(node, tokens)
            self.leave(node)
