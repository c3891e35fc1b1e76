"""Routing to a pool of nodes: join-the-shortest-queue by pending tokens (Splitwise §4.2),
KV-aware, or round-robin.

A P-node's queue is the prompt tokens it still has to prefill; a T-node's is
the tokens its admitted requests may still generate, and colocated the prompt
tokens it has yet to prefill. A node that holds as many requests as it has
slots is passed over while another has room: a request sent there would only
wait for a slot, holding its seat (on the code trace, 6 P-nodes on 2 T-nodes
served 12% below the simulator while one T-node was full and the other half
empty). A node that failed is left out for ``down_s`` seconds so a dead node
with an empty queue does not attract every request.

Several routers may share a pool (``dejavu up --frontends N``, ``--frontend-instances N``):
each counts only its own requests, and the node itself refuses a slot it does not have. A
node that refused (:meth:`Router.mark_full`) is passed over like a full one for a while, so
the request goes to another node at once instead of waiting for this one.

KV-aware (``policy="kv"``, as Dynamo's KV router): the router keeps a :class:`KVIndex` of
which node's prefix cache holds which block, fed by the nodes' signed KV events
(:mod:`orchestrator.kv.events`), and sends a prompt to the node with the lowest
``kv_weight * (prompt tokens it would compute) + its pending tokens``; a node marked
down leaves the index at once (its cache may be gone with it).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# Leads the message of a request that failed because no node could serve it (every one of a
# pool down, or still failing after the reruns): a decoupled model's error reaches a gRPC
# client as text only, so clients (the OpenAI API: HTTP 503) tell it apart by this.
UNAVAILABLE = "no node can serve the request"


class NoNodeError(RuntimeError):
    """Every node of a pool is down."""


POLICIES = ("jsq", "kv", "round-robin")
# A prompt's saved tokens against a node's queue (kv): 4, not 1:1, because a hit also keeps
# the conversation's next turns on the node that holds it. On 10 min of the Mooncake
# conversation trace, 6P+2T: hit rate 19.4% -> 21.9%, TTFT p99 7.7 -> 4.1 s (JSQ 4.6 s).
DEFAULT_KV_WEIGHT = 4.0


class KVIndex:
    """Which node holds which prefix-cache block, as the nodes' KV events say."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.cursors: dict[str, str] = {}  # where each node's events were read up to

    def apply(self, node: str, answer: dict) -> None:
        """A node's answer to :meth:`~orchestrator.kv.events.KVEventLog.since`."""
        held = self.blocks.setdefault(node, set())
        if "reset" in answer:
            held.clear()
            held.update(answer["reset"])
        for kind, hashes in answer.get("events", []):
            (held.update if kind == "stored" else held.difference_update)(hashes)
        self.cursors[node] = answer["cursor"]

    def overlap(self, node: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the node holds (a hit needs every one from the
        first)."""
        held = self.blocks.get(node, ())
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def drop(self, node: str) -> None:
        self.blocks.pop(node, None)
        self.cursors.pop(node, None)


class Router:
    def __init__(self, nodes: list[str], down_s: float = 5.0,
                 slots: dict[str, int] | None = None, policy: str = "jsq",
                 kv_weight: float = DEFAULT_KV_WEIGHT, block_tokens: int = 32) -> None:
        """``slots``: the requests each node holds at once (none given: no bound);
        ``policy``: jsq, kv or round-robin; ``kv_weight``: the weight of a prompt's tokens
        to compute against the node's pending tokens (kv); ``block_tokens``: the nodes'
        prefix-cache block size (kv)."""
        if not nodes:
            raise ValueError("a router needs at least one node")
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy, self.kv_weight, self.block_tokens = policy, kv_weight, block_tokens
        self.index = KVIndex()
        self._turn = itertools.count()
        self.pending: dict[str, int] = dict.fromkeys(nodes, 0)
        self.held: dict[str, int] = dict.fromkeys(nodes, 0)  # requests routed, not yet left
        self.slots = slots or {}
        self.down_until: dict[str, float] = dict.fromkeys(nodes, 0.0)
        self.full_until: dict[str, float] = dict.fromkeys(nodes, 0.0)  # it refused a slot
        self.down_s = down_s
        self.revivals = 0  # nodes marked up while down: a request waiting to rerun goes now
        self.lock = threading.Lock()

    def pick(self, tokens: int, hashes: Sequence[int] = ()) -> str:
        """A live node, among those with a free slot if any, by the policy: the fewest
        pending tokens (jsq), the lowest cost of ``hashes`` (the prompt's block hashes) to
        compute there and its pending tokens (kv), or the next in turn; ``tokens`` join its
        queue and the request holds it until :meth:`leave`."""
        return self.route(tokens, hashes)[0]

    def route(self, tokens: int, hashes: Sequence[int] = (),
              prompt_tokens: int | None = None) -> tuple[str, int]:
        """:meth:`pick`, and the tokens charged to the node's queue (kv: ``tokens`` less
        those cached there); :meth:`done` gives them back. ``prompt_tokens`` (kv, T-nodes
        of decode-side reuse): the prompt's tokens a node lacks are weighed instead (what
        its P-node would stream to it), and ``tokens`` charged whole."""
        now = time.monotonic()
        with self.lock:
            live = self._live(now)
            free = self._free(live, now) or live
            work = dict.fromkeys(free, tokens)
            if self.policy == "round-robin":
                node = free[next(self._turn) % len(free)]
            elif self.policy == "kv" and hashes:
                # at least one token is computed (or streamed), however much is cached
                prompt = tokens if prompt_tokens is None else prompt_tokens
                lacks = {n: max(1, prompt - self.index.overlap(n, hashes) * self.block_tokens)
                         for n in free}
                if prompt_tokens is None:
                    work = lacks
                node = min(free, key=lambda n: (self.kv_weight * lacks[n] + self.pending[n],
                                                self.pending[n]))
            else:
                node = min(free, key=lambda n: self.pending[n])
            self.pending[node] += work[node]
            self.held[node] += 1
            return node, work[node]

    def _live(self, now: float) -> list[str]:
        live = [n for n in self.pending if self.down_until[n] <= now]
        if not live:
            raise NoNodeError(f"all nodes down: {', '.join(self.pending)}")
        return live

    def check_live(self) -> None:
        """Raises NoNodeError when every node is down."""
        with self.lock:
            self._live(time.monotonic())

    def _free(self, nodes: list[str], now: float) -> list[str]:
        """Those of ``nodes`` with a slot as far as this router knows."""
        return [n for n in nodes
                if self.held[n] < self.slots.get(n, math.inf) and self.full_until[n] <= now]

    def has_room(self) -> bool:
        """A live node with a slot as far as this router knows: a request another node
        refused may go there at once."""
        now = time.monotonic()
        with self.lock:
            return bool(self._free([n for n in self.pending if self.down_until[n] <= now],
                                   now))

    def mark_full(self, node: str, for_s: float) -> None:
        """``node`` refused a slot (requests routed by others hold them all): pass it over
        while another has room, for ``for_s`` seconds."""
        with self.lock:
            self.full_until[node] = time.monotonic() + for_s

    def hold(self, node: str, tokens: int) -> None:
        """A request goes on at ``node`` (re-attached there, not routed): counted as routed."""
        with self.lock:
            self.pending[node] += tokens
            self.held[node] += 1

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
            self.index.drop(node)  # its cache may be lost with it: soft state

    def kv_cursor(self, node: str) -> str:
        with self.lock:
            return self.index.cursors.get(node, "")

    def kv_events(self, node: str, answer: dict) -> None:
        """Index a node's KV events (verified: :func:`~orchestrator.kv.events.decode_events`)."""
        with self.lock:
            if self.down_until[node] <= time.monotonic():
                self.index.apply(node, answer)

    def is_up(self, node: str) -> bool:
        """Not marked down (or its down time is over)."""
        with self.lock:
            return self.down_until[node] <= time.monotonic()

    def mark_up(self, node: str) -> None:
        with self.lock:
            if self.down_until[node] > time.monotonic():
                self.revivals += 1
            self.down_until[node] = 0.0

    @contextmanager
    def assign(self, tokens: int, hashes: Sequence[int] = ()) -> Iterator[str]:
        node, charged = self.route(tokens, hashes)
        try:
            yield node
        finally:
            self.done(node, charged)
            self.leave(node)
