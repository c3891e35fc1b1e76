"""A T-node: one stage of a token pipeline on a tritonserver; stage 0 also admits requests.

Disaggregated: the node runs a :class:`~orchestrator.pipeline.node.StageNode`.
Stage 0 holds the pipeline's head: a request reserves its prompt KV slot
here (the ticket is the first response; the frontend reserved one on every
other stage before), joins the head at once, and streams every token after
the first (the P-node's, which the client already has). Colocated: the
pipeline (``mode="colocated"``) runs each prompt in its own steps, stage by
stage. Either way the token loop is the pipeline library's.

Control requests bootstrap a pipeline (``endpoints``, ``connect``, ``start``),
reserve or release prompt KV (``reserve``, ``release``) on any stage, and end a
request whose client left (``end``, stage 0: the request's stream then closes with
an empty final response, so the frontend never cancels a gRPC call, whose
cancellation races with a response in Triton 2.51, issues 7368 and 8034); with
KV replication on, the fault layer's operations (``RecoveryOps.ops``) wire the
replicas and replace a lost stage. ``held`` counts what requests hold on the node,
``steps`` times its latest engine steps.

Tokens leave through a sender thread, not the head's: answering a request costs
a round trip to tritonserver (relayed by the node's Triton stub: the service runs in
a process of its own, :mod:`orchestrator.serving.service_process`), which would
otherwise delay the next step. A
stream whose tokens pile up while its responses go out gets them in one
response. A request that names a *token feed* (a long-lived request of the
frontend's, opened with the ``feed`` op, :mod:`orchestrator.serving.feed`)
gets its tokens there instead: one feed message carries the new tokens of every
request of that feed, so a step of B requests costs one message, not B Triton
responses. The request's own stream then carries its KV ticket, its failure,
and an empty last response.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.engine.base import Engine
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.fault.stage_recovery import RecoveryOps
from orchestrator.pipeline.head import PipelineHead
from orchestrator.pipeline.node import StageNode
from orchestrator.pipeline.sequence import FinishReason, Sequence
from orchestrator.serving.control_request import ControlRequest, Emit  # re-exported
from orchestrator.serving.feed import FeedRow, RowSink
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.params import GenerationParams, RequestError, check_prompt

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Feed:
    """Where the tokens of the requests naming this feed go."""

    rows: RowSink
    close_stream: Callable[[], None]  # the feed request's final response: Triton frees it

    def close(self) -> None:
        self.rows.close()
        self.close_stream()


@dataclass(eq=False)
class _Client:
    """Where one request's tokens go."""

    emit: Emit
    fail: Callable[[str], None]  # final error response
    sent: int  # tokens handed to the sender (disaggregated: the P-node sent the first)
    reserved_at: float
    outbox: list[int] = field(default_factory=list)  # made, not yet answered
    log_probs: list[TokenLogProb] | None = None  # the outbox's, if the request asked
    final: bool = False
    error: str | None = None
    ended: bool = False  # by an ``end`` op: its stream still wants a final response
    request_id: str = ""
    feed: str | None = None  # the token feed its tokens go to (None: its own stream)
    cached_tokens: int = 0  # colocated: its prompt's tokens the prefix cache held
    kv_since: str | None = None  # a KV-aware router's: its last response carries the prefix
    # cache's events since this cursor (colocated; disaggregated: decode-side reuse's cache)
    kv_reused: int = 0  # disaggregated: its prompt's positions this node held (not streamed)


class TokenService:
    """One stage (``node``) of a token pipeline, disaggregated or colocated."""

    def __init__(
        self,
        engine: Engine,
        *,
        node: StageNode,
        recovery: RecoveryOps | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``recovery``: the node's replication and recovery operations (replication on)."""
        self.engine, self.node = engine, node
        self.recovery = recovery
        self.ops = self._control_ops()
        self.head: PipelineHead | None = node.head
        self.metrics = metrics or Metrics()
        self.clients: dict[str, _Client] = {}
        self.feeds: dict[str, _Feed] = {}
        self.lock = threading.Lock()
        self._feed_rows: dict[str, list[FeedRow]] = {}  # made, not yet sent, per feed
        self._feed_lock = threading.Lock()  # one sender at a time: a feed's rows in order
        self._outbox = threading.Condition()
        self._ready: dict[_Client, None] = {}  # clients with something to send, in order
        self._ended_feeds: list[_Feed] = []  # their final response is due
        self._closing = False
        self.sender = threading.Thread(target=self._send_loop, name="token-sender", daemon=True)
        self.sender.start()
        if self.head is not None:  # a step's tokens go out in one message per feed
            self.head.on_step = self._flush_feeds
        if node.decode_reuse is not None:
            node.decode_reuse.on_stored = self.metrics.prefix_cache

    @property
    def colocated(self) -> bool:
        return self.node.config.mode == "colocated"

    # -- control requests --------------------------------------------------------------

    def _control_ops(self) -> dict[str, Callable[[ControlRequest], bytes | None]]:
        requests = {"held": lambda _: json.dumps(self.held()).encode(), "end": self._end,
                    "steps": lambda _: json.dumps(self.steps()).encode()}
        node = self.node
        ops: dict[str, Callable[[ControlRequest], bytes | None]] = {}
        if node.config.depth > 1:
            ops |= {"endpoints": lambda _: node.endpoints(), "connect": self._connect,
                    "start": lambda _: node.start() and None}
        if not self.colocated:
            ops |= {"reserve": self._reserve,
                    "release": lambda r: node.release_prompt(r.request_id)}
        if self.recovery is not None:
            ops |= {name: lambda r, op=op: op(*r.args)
                    for name, op in self.recovery.ops().items()}
        return ops | requests

    def control(self, op: str, request: ControlRequest) -> bytes:
        """Run the control operation named ``op``; the bytes to answer with."""
        handler = self.ops.get(op)
        if handler is None:
            where = "a colocated node takes no prompt KV" if self.colocated else (
                "this node does not replicate its KV" if self.recovery is None else "")
            raise RequestError(f"unknown op {op!r}{f' ({where})' if where else ''}: "
                               f"this node answers {sorted(self.ops) or 'none'}")
        try:
            answer = handler(request)
        except TypeError as exc:  # wrong number of arguments
            raise RequestError(f"op {op!r}: {exc}") from exc
        return b"" if answer is None else answer

    def _connect(self, request: ControlRequest) -> None:
        if len(request.args) != 2:
            raise RequestError("op 'connect' needs peers = [next endpoints, head endpoints]")
        self.node.connect(*request.args)

    def _reserve(self, request: ControlRequest) -> bytes:
        if request.prompt_len < 1:
            raise RequestError("op 'reserve' needs the prompt (input_ids)")
        return self.node.reserve_prompt(request.request_id, request.prompt_len)

    def _end(self, request: ControlRequest) -> bytes:
        """End a request whose client left, or a token feed; b"1" if it was open here."""
        if self.head is None:
            raise RequestError("op 'end' goes to stage 0, where requests run")
        with self.lock:
            client = self.clients.get(request.request_id)
            if client is not None:
                client.ended = True
        return b"1" if self.cancel(request.request_id) else b"0"

    def open_feed(self, feed_id: str, rows: RowSink, close_stream: Callable[[], None]
                  ) -> None:
        """A token feed: the requests that name it get their tokens through ``rows``; it
        ends (``close_stream``: the feed request's final response) with an ``end`` op naming
        it, its :meth:`cancel` or the node's stop."""
        try:
            if self.head is None:
                raise RequestError("op 'feed' goes to stage 0, where requests run")
            with self.lock:
                if feed_id in self.feeds or feed_id in self.clients:
                    raise RequestError(f"request id {feed_id!r} is already open here")
                self.feeds[feed_id] = _Feed(rows, close_stream)
        except RequestError:
            rows.close()
            raise

    def _end_feed(self, feed: _Feed) -> None:
        """Its final response goes out from the sender, after what it already holds."""
        with self._outbox:
            self._ended_feeds.append(feed)
            self._outbox.notify()

    def held(self) -> dict[str, int]:
        """What requests hold on this node, each 0 once every request ended: clients,
        prompt-KV slots, sequences' KV, replicas and restored KV."""
        with self.lock:
            counts = {"clients": len(self.clients)}
        counts["kv"] = len(self.node.kv)
        if self.node.receiver is not None:  # disaggregated: prompt KV slots
            counts["slots"] = self.node.receiver.held()
        if self.recovery is not None:
            counts |= self.recovery.replication.held_counts()
        return counts

    def steps(self) -> dict[str, dict[str, float]]:
        """This stage's latest engine steps (its worker's busy intervals), per kind: how many
        and their median in ms: what a step costs inside this node's process."""
        worker = self.node.worker
        by_kind: dict[str, list[float]] = {}
        for interval in list(worker.timeline) if worker is not None else []:
            by_kind.setdefault(interval.kind, []).append((interval.end - interval.start) * 1e3)
        return {kind: {"count": len(ms), "median_ms": statistics.median(ms)}
                for kind, ms in by_kind.items()}

    # -- generation (stage 0) ----------------------------------------------------------

    def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: GenerationParams,
        emit: Emit,
        fail: Callable[[str], None],
        send_ticket: Callable[[bytes], None],
        feed: str | None = None,
        kv_since: str | None = None,
    ) -> None:
        """Raises RequestError (nothing held) if the request cannot be served. ``feed``: the
        token feed its tokens go to (None: ``emit`` them on its own stream); ``kv_since``:
        a KV-aware router's cursor (:mod:`orchestrator.kv.events`)."""
        if self.head is None:
            raise RequestError(f"stage {self.node.index} of a token pipeline: generate "
                               "requests go to stage 0")
        check_prompt(prompt_ids, params, self.head.max_seq_len, self.engine.vocab_size)
        if any(not 0 <= t < self.engine.vocab_size for t in params.delivered):
            raise RequestError(f"delivered tokens outside the vocabulary of "
                               f"{self.engine.vocab_size}")
        seq = Sequence(request_id, prompt_ids, params.max_tokens, params.end_id,
                       params.sampling(prompt_ids), self._on_token,
                       stop_words=params.stop_words, cache_salt=params.cache_salt)
        with self.lock:
            if request_id in self.clients or request_id in self.feeds:
                raise RequestError(f"request id {request_id!r} is already running here")
            if feed is not None and feed not in self.feeds:
                raise RequestError(f"no token feed {feed!r} is open here")
            self.clients[request_id] = _Client(
                emit, fail, len(params.delivered) or (0 if self.colocated else 1),
                time.perf_counter(),
                log_probs=[] if params.return_log_probs else None, request_id=request_id,
                feed=feed, kv_since=kv_since)
            self.metrics.queue_length(len(self.clients))
        try:
            if params.delivered:  # a lost head's request, its KV kept on the stages
                self.head.reattach(seq, params.delivered)
                return
            if self.colocated:
                self.head.submit(seq)
                return
            ticket = self.node.reserve_prompt(request_id, len(prompt_ids), prompt_ids,
                                              params.cache_salt)
            self._count_reuse(request_id)
            try:
                self.head.submit_prefilled(seq)
            except Exception:
                self.node.release_prompt(request_id)
                raise
        except Exception as exc:
            self._forget(request_id)
            raise RequestError(str(exc)) from exc
        try:
            send_ticket(ticket)
        except Exception:
            self.head.cancel(request_id)  # its KV is released on every stage by the head
            raise

    def _on_token(self, seq: Sequence, token: int | None, finished: bool) -> None:
        """On the head's thread: pass the token on, never raise."""
        with self.lock:  # forgotten before its last response goes out
            client = self.clients.pop(seq.request_id) if finished else self.clients.get(
                seq.request_id)
            if finished:
                self.metrics.queue_length(len(self.clients))
        if client is None:
            return
        try:
            if not self.colocated and len(seq.output_ids) == 1 and token is not None:
                self._count_kv(seq, client)
            if finished and seq.finish_reason not in (FinishReason.CANCELLED,
                                                      FinishReason.ERROR):
                self.node.keep(seq)  # before its final response: its events name the blocks
            if self.colocated and len(seq.output_ids) == 1 and self.node.prefix:
                client.cached_tokens = seq.cached_tokens
                self.metrics.prefix_cache(self.node.prefix.cache)
            if token is None:
                if seq.finish_reason is not FinishReason.CANCELLED:
                    self._send(client, [], seq.error or
                               f"ended ({seq.finish_reason.value}) without a token")
                elif client.ended:  # else Triton cancelled it: its stream is gone
                    self._feed_row(client, [], None, True)
                    self._send(client, [], finished=True)
            elif finished or len(seq.output_ids) > client.sent:
                tokens, log_probs = seq.output_ids[client.sent :], seq.log_probs[client.sent :]
                client.sent = len(seq.output_ids)
                if client.feed is None:
                    self._send(client, tokens, finished=finished, log_probs=log_probs)
                else:  # sent with the step's others; its own stream's last response after
                    self._feed_row(client, tokens, log_probs, finished)
                    if finished:
                        self._send(client, [], finished=True)
        except Exception:
            log.exception("could not answer request %s", seq.request_id)
        if finished:
            outcome = {FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "failed"}
            self.metrics.request_done(outcome.get(seq.finish_reason, "finished"))

    def _send(self, client: _Client, tokens: list[int], error: str | None = None,
              finished: bool = False, log_probs: list[TokenLogProb | None] = ()) -> None:
        with self._outbox:
            client.outbox += tokens
            if client.log_probs is not None:
                client.log_probs += log_probs
            client.final |= finished
            client.error = client.error or error
            self._ready[client] = None
            self._outbox.notify()

    def _feed_row(self, client: _Client, tokens: list[int],
                  log_probs: list[TokenLogProb | None], done: bool) -> None:
        if client.feed is None:
            return
        with self._feed_lock:
            asked = client.log_probs is not None
            self._feed_rows.setdefault(client.feed, []).append(
                (client.request_id, tokens, log_probs if asked else None, done))

    def _flush_feeds(self) -> None:
        """Send each feed's rows made so far as one message: on the head's thread after
        each step, and on the sender's before it answers (a request's own last response
        goes after its rows)."""
        with self._feed_lock:
            rows, self._feed_rows = self._feed_rows, {}
            if not rows:
                return
            with self.lock:
                feeds = {name: self.feeds.get(name) for name in rows}
            for name, feed_rows in rows.items():
                self._answer(feeds[name].rows.send if feeds[name] else None, feed_rows)

    def _send_loop(self) -> None:
        """Answer every client with something to send: all its tokens in one response (its
        feed's rows, if it has one, are sent first)."""
        while True:
            with self._outbox:
                self._outbox.wait_for(lambda: self._ready or self._ended_feeds or self._closing)
                if not (self._ready or self._ended_feeds):
                    return
                work = [(c, c.outbox, c.log_probs, c.final, c.error) for c in self._ready]
                for client in self._ready:
                    client.outbox = []
                    client.log_probs = None if client.log_probs is None else []
                self._ready.clear()
                ended, self._ended_feeds = self._ended_feeds, []
            self._flush_feeds()
            for client, tokens, log_probs, final, error in work:
                # the last response says the prompt's cached tokens and the cache's events
                # (colocated)
                cached = self._prefix_outputs(client) if final else ()
                if client.feed is None and (tokens or final):
                    self._answer(client.emit, tokens, log_probs, final, *cached)
                elif final:  # its tokens went to the feed: the stream's own last response
                    self._answer(client.emit, [], None, True, *cached)
                if error is not None:
                    self._answer(client.fail, error)
            for feed in ended:
                self._answer(feed.close)

    def _prefix_outputs(self, client: _Client) -> tuple:
        """A request's last response's extra outputs: (cached tokens[, its router's KV
        events, signed]), or none. Disaggregated, the events are decode-side reuse's (the
        P-node says the cached tokens)."""
        prefix = self.node.prefix if self.colocated else self.node.decode_reuse
        if prefix is None:
            return ()
        if client.kv_since is None:
            return (client.cached_tokens,) if client.cached_tokens else ()
        return client.cached_tokens, prefix.events.answer(client.kv_since)

    @staticmethod
    def _answer(send: Callable[..., None] | None, *args: object) -> None:
        if send is None:
            return  # its feed ended: the requests on it end with their streams
        try:
            send(*args)
        except Exception:
            log.exception("could not answer a request")

    def _count_kv(self, seq: Sequence, client: _Client) -> None:
        """The prompt KV of every stage has landed: count the whole model's bytes streamed
        (the positions this node held were not)."""
        nbytes = (seq.prompt_len - client.kv_reused) * self._token_bytes()
        self.metrics.kv_streamed(nbytes, time.perf_counter() - client.reserved_at)

    def _count_reuse(self, request_id: str) -> None:
        """Decode-side reuse: the prompt's positions its slot already held."""
        reused = self.node.receiver.reused(request_id)
        if reused:
            with self.lock:
                self.clients[request_id].kv_reused = reused
            self.metrics.kv_reused(reused * self._token_bytes())
            self.metrics.prefix_cache(self.node.decode_reuse.cache)

    def _token_bytes(self) -> int:
        """KV bytes of one token, the whole model's."""
        return self.engine.kv_layout.token_bytes_per_layer() * self.engine.stage.num_layers

    def _forget(self, request_id: str) -> None:
        with self.lock:
            self.clients.pop(request_id, None)
            self.metrics.queue_length(len(self.clients))

    def cancel(self, request_id: str) -> bool:
        """End request or token feed ``request_id`` (Triton says its client left, or an
        ``end`` op): the request at its next step (with no last response unless an ``end``
        asked for one), the feed with its final response. True if it was open here."""
        with self.lock:
            feed = self.feeds.pop(request_id, None)
        if feed is not None:
            self._end_feed(feed)
            return True
        return self.head is not None and self.head.cancel(request_id)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.node.close(timeout_s)
        if self.recovery is not None:
            self.recovery.replication.close()
        with self.lock:
            ended, self.feeds = list(self.feeds.values()), {}
        with self._outbox:  # the answers the stop made (errors) still go out
            self._ended_feeds += ended
            self._closing = True
            self._outbox.notify()
        self.sender.join(timeout_s)
