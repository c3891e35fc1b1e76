"""The frontend's per-request path: route, hand the prompt from P to T, relay tokens.

Disaggregated: the chosen token pipeline's stages 1..D-1 each reserve a KV
slot for the prompt (a control request), then the request goes to the decode
model on stage 0, whose first response is its own KV ticket; the chosen P-node
prefills, streams each layer's KV into the stage that holds it and returns the
first token, which goes to the client at once; stage 0's tokens follow.
Colocated: the T-node prefills itself and every token comes from it. All calls
are Triton gRPC; every request to a stage 0 goes on the one stream this
frontend keeps to it, and the tokens of all of them come back on a token feed,
a message per pipeline step (:mod:`orchestrator.serving.node_stream`). A stream
that fell behind gets every token waiting for it in one response, as vLLM's
output collector merges them.

A P-node lost mid-prompt (unreachable, killed while prefilling, or its KV
transfer failed) costs the client a pause, not an error: the frontend cancels
the T-side admission (the head frees every stage's slot), reserves afresh and
runs the prompt once more on another P-node, or on a warm P spare that took the
lost one's role (at its own address, once the controller knows it there); the
router leaves the lost node out for a while. Prefill is deterministic, so the
tokens do not change.

A request the token pipeline fails after admitting it (a stage lost with no
replica to resume from, a lost head; a stage that recovers from its replicas
fails nothing) runs again from its prompt on a pipeline that serves, and the
client never sees a token twice. A spare that took a lost stage 0 over serves at its
own address: the frontend follows it there, once the controller has closed the repair,
and re-attaches each request the lost head held, with the tokens its client already
has; the new head goes on from the KV the stages kept (stage 0's restored from its
replica on stage 1). Only a request the new head kept nothing of runs again from its
prompt.

With a fault controller (``controller``), a watcher thread asks it every
``watch_s`` which nodes it has declared dead and keeps them (and every token
pipeline with a dead stage) out of the routers, and learns where each stage
of a token pipeline is now (a warm spare that took over a lost stage serves
it at its own address). While the controller is away the routers go by the
failures they meet alone.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from orchestrator.control.auth import Unauthenticated, request_parameters
from orchestrator.control.client import (
    ClientPool,
    ControlClient,
    connect,
    is_unreachable,
    raise_for_error,
    tensor,
)
from orchestrator.control.errors import ControlError, ErrorCode
from orchestrator.engine.log_probs import TokenLogProb
from orchestrator.engine.log_probs import decode as decode_log_probs
from orchestrator.fault.rpc import Stub
from orchestrator.kv.events import decode_events
from orchestrator.kv.prefix_cache import block_hashes
from orchestrator.serving.feed import FeedListener
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.node_stream import (
    CANCEL_POLL_S,
    Cancelled,
    NodeStream,
    RequestStream,
    StreamTimeout,
)
from orchestrator.serving.params import GenerationParams
from orchestrator.serving.router import DEFAULT_KV_WEIGHT, NoNodeError, Router
from orchestrator.serving.text import CONTEXT_TOKENS
from orchestrator.serving.usage import RequestUsage

log = logging.getLogger(__name__)

# tokens of this response, their log-probs (None: not asked for), the tokens already sent
# just before them, is it the last
Emit = Callable[[list[int], list[TokenLogProb] | None, list[int], bool], None]
# new tokens, their log-probs (None: not asked for), is it the last
Relay = Callable[[list[int], list[TokenLogProb] | None, bool], None]


class ServingError(RuntimeError):
    """A downstream node failed or refused the request; the message says which and why."""


class PrefillLost(ServingError):
    """The P-node went away or its KV never landed: the prompt may run on another P-node."""


class NodeBusy(ServingError):
    """A T-node's prompt-KV slots are all taken: the request waits and tries again."""


class PipelineLost(ServingError):
    """The token pipeline failed a request it had admitted: it may run again from its prompt."""


class NotKept(PipelineLost):
    """The pipeline's new head kept nothing of a re-attached request: it runs again from its
    prompt."""


class Refused(ServingError):
    """A node refused the request itself (bad parameters, a failed step it would fail again):
    never run again."""


_BUSY_WAIT_S, _MAX_BUSY_WAIT_S = 0.05, 1.0  # first and longest wait for a free KV slot
_REPAIR_POLL_S = 0.02  # a request to re-attach waits for its pipeline's repair, polling
_MAX_RERUN_WAIT_S = 8.0  # longest wait before a lost request runs again
FRONTEND_TIMEOUT_S = 60.0  # a request's longest wait for a seat, a slot, or its node's word


@dataclass
class _Attempt:
    """Where a request's pipeline holds it now (``request_id`` None: no pipeline holds it)."""

    url: str = ""  # the pipeline (its configured head)
    request_id: str | None = None
    head_at: str = ""  # the head's address then


def request_arrays(prompt_ids: list[int], params: GenerationParams) -> dict[str, np.ndarray]:
    """A generate request to a P-node or T-node: the prompt, and the checked parameters."""
    return {"input_ids": np.array(prompt_ids, dtype=np.int32),
            "params": np.array([params.to_json()], dtype=np.object_)}


def _decode_error(error: Exception, where: str, admitted: bool) -> ServingError:
    """What a T-node's failure means for the request: its pipeline lost it (after
    admission, or the node is unreachable: run it again), the node is full (wait), or it
    refused."""
    text = error.message() if isinstance(error, InferenceServerException) else str(error)
    message = f"{where}: {text}"
    if admitted or is_unreachable(error):
        return PipelineLost(message)
    if isinstance(error, ControlError) and error.code is ErrorCode.NO_FREE_SLOT:
        return NodeBusy(message)
    return ServingError(message)


class Frontend:
    def __init__(
        self, prefill_urls: list[str], decode_pipelines: list[list[str]],
        secret: bytes, timeout_s: float = FRONTEND_TIMEOUT_S, controller: str = "",
        watch_s: float = 0.1,
        rerun_wait_s: float = 1.0, metrics: Metrics | None = None, max_sequences: int = 0,
        pipeline_sequences: list[int] | None = None, stream_interval: int = 1,
        router: str = "jsq", kv_weight: float = DEFAULT_KV_WEIGHT, kv_block: int = 32,
        decode_reuse: bool = False,
    ) -> None:
        """``decode_pipelines``: each token pipeline's stage urls, stage 0 (its head) first;
        ``secret``: the cluster's (every request to a node is signed with it);
        ``controller``: the fault controller's address (empty: none); ``metrics``: counts
        the reruns; ``max_sequences``: sequences in flight at once (0: no bound), the
        rest wait their turn here instead of asking the T-nodes for a slot again and
        again; ``pipeline_sequences``: those each pipeline holds (the router passes
        over a full one); ``stream_interval``: tokens per streamed response after the
        first (which goes at once), as vLLM's and TensorRT-LLM's; ``router``: jsq, kv
        (the P-nodes by their cached prefixes) or round-robin, ``kv_weight`` and
        ``kv_block`` its (:class:`Router`); ``decode_reuse``: the T-nodes keep finished
        requests' KV (decode-side reuse), so kv routes them too, by the blocks they hold."""
        self.prefill = (Router(prefill_urls, policy=router, kv_weight=kv_weight,
                               block_tokens=kv_block) if prefill_urls else None)
        self.kv_block = kv_block  # the unit of a request's kv_cache_* counts
        heads = [stages[0] for stages in decode_pipelines]
        # kv routes the nodes that hold prompt KV: the T-nodes when colocated, or keeping
        # finished requests' (pipelines of depth 1)
        self.decode_reuse = decode_reuse and all(len(s) == 1 for s in decode_pipelines)
        self.decode = Router(heads, slots=dict(zip(heads, pipeline_sequences or [],
                                                   strict=False)),
                             policy="jsq" if router == "kv" and prefill_urls
                             and not self.decode_reuse else router,
                             kv_weight=kv_weight, block_tokens=kv_block)
        self.later_stages = {stages[0]: stages[1:] for stages in decode_pipelines}
        # The controller's name of each token pipeline (the launcher's order) -> its head.
        self.heads = {f"decode{i}": stages[0] for i, stages in enumerate(decode_pipelines)}
        # Each head's address now (a spare that took a lost stage 0 over serves at its own);
        # the routers go on naming the pipeline by its configured head.
        self.head_at = {stages[0]: stages[0] for stages in decode_pipelines}
        self.timeout_s, self.rerun_wait_s = timeout_s, rerun_wait_s
        self.max_sequences, self.stream_interval = max_sequences, stream_interval
        self.seats = threading.Semaphore(max_sequences) if max_sequences else None
        self.secret, self.pool = secret, ClientPool()
        self.control = ControlClient(secret, timeout_s, self.pool)
        # Each P-node's address now, by its configured one (the router's name for it): a
        # warm P spare that took a lost P-node's role serves it at its own address.
        self.prefill_at = {url: url for url in prefill_urls}
        self.prefill_names = {f"prefill{i}": url for i, url in enumerate(prefill_urls)}
        self.prefill_clients = {url: connect(url) for url in prefill_urls}
        self.streams: dict[str, NodeStream] = {}  # stage 0 url -> the one stream to it
        self.streams_lock = threading.Lock()
        self.feeds = FeedListener(secret)  # where every stage 0 pushes its tokens
        self.metrics = metrics or Metrics()
        self.stopped = threading.Event()
        self.watcher = None
        self.status_stub: Stub | None = None
        self.prefill_seen_alive: dict[str, bool] = {}  # P-node url -> at the last look
        if controller:
            self.status_stub = Stub(controller, secret)  # asked every watch_s: kept
            # Before serving: a frontend started again after a spare took a stage over would
            # otherwise send its first requests to the configured address, a spare's now.
            self._look(min(watch_s, 2.0))
            self.watcher = threading.Thread(target=self._watch, args=(watch_s,),
                                            name="controller-watch", daemon=True)
            self.watcher.start()

    def _watch(self, watch_s: float) -> None:
        # Often: a node is declared dead within ~50 ms of its process's end (the supervisor's
        # pid watch), and new requests should go elsewhere from then on, not meet it first.
        while not self.stopped.wait(watch_s):
            self._look(max(watch_s, 1.0))

    def _look(self, timeout_s: float) -> None:
        """Ask the controller which nodes are alive and where each stage is now."""
        import grpc

        from orchestrator.fault.client import query_status

        try:
            status = query_status(self.status_stub, timeout_s=timeout_s)
        except grpc.RpcError:
            return  # the controller is away: go by the failures met
        nodes = status["nodes"]
        # A head under repair: its replacement registers before the repair ends (a lost later
        # stage's pipeline keeps its head, where requests wait for the repair).
        repairing = {self.heads.get(name) for name, p in status["pipelines"].items()
                     if 0 in p["failed"]}
        alive = {}  # the latest registration per address wins
        for node in nodes:
            alive[node["address"]] = node["alive"]
        dead = {address for address, ok in alive.items() if not ok}
        self._follow_prefill(nodes)
        for url in self.prefill_clients:
            address = self.prefill_at[url]
            if address in dead:
                self.prefill.mark_down(url)
            elif alive.get(address) and not self.prefill_seen_alive.get(address, False):
                # Started again (or a spare took its role): use it at once. Only then: a
                # node this frontend saw fail is still alive to the controller until it
                # declares it dead, and put back, it took the prompts rerun a moment later too.
                self.prefill.mark_up(url)
            self.prefill_seen_alive[address] = bool(alive.get(address))
        self._follow_stages(nodes)
        for head, later in self.later_stages.items():
            stages = {self.head_at[head], *later}
            if dead & stages or head in repairing:
                self.decode.mark_down(head)
            elif all(alive.get(url) for url in stages):
                self.decode.mark_up(head)  # e.g. a lost stage was replaced

    def _follow_prefill(self, nodes: list[dict]) -> None:
        """Each P-node's address: the latest live registration in its place."""
        for node in nodes:
            url = self.prefill_names.get(node["pipeline"])
            if url is None or not node["alive"] or self.prefill_at[url] == node["address"]:
                continue
            log.warning("%s is at %s now", node["pipeline"], node["address"])
            client, self.prefill_clients[url] = (self.prefill_clients[url],
                                                 connect(node["address"]))
            self.prefill_at[url] = node["address"]
            client.close()

    def _follow_stages(self, nodes: list[dict]) -> None:
        """Each stage's address: the latest live registration in its slot."""
        for node in nodes:
            head = self.heads.get(node["pipeline"])
            if head is None or not node["alive"] or not 0 <= node["stage"] <= len(
                    self.later_stages[head]):
                continue
            if node["stage"] == 0:
                if self.head_at[head] != node["address"]:
                    log.warning("stage 0 of %s is at %s now", node["pipeline"],
                                node["address"])
                    self.head_at[head] = node["address"]
                continue
            later = list(self.later_stages[head])
            if later[node["stage"] - 1] != node["address"]:
                log.warning("stage %d of %s is at %s now", node["stage"], node["pipeline"],
                            node["address"])
                later[node["stage"] - 1] = node["address"]
                self.later_stages[head] = later  # one assignment: requests read it as a whole

    def close(self) -> None:
        self.stopped.set()
        if self.watcher is not None:
            self.watcher.join(timeout=5)
        if self.status_stub is not None:
            self.status_stub.close()
        self.control.close()
        for client in self.prefill_clients.values():
            client.close()
        with self.streams_lock:
            streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream.close()
        self.feeds.close()

    def _node_stream(self, head: str) -> NodeStream:
        """The stream to pipeline ``head``'s stage 0, where it is now; a broken one is
        replaced (the node died or was started again)."""
        url = self.head_at.get(head, head)
        with self.streams_lock:
            stream = self.streams.get(url)
            if stream is not None and stream.broken is None:
                return stream
            self.streams.pop(url, None)
        if stream is not None:
            stream.close()
        stream = NodeStream(url, self.secret, self.feeds)
        with self.streams_lock:
            racing = self.streams.setdefault(url, stream)
        if racing is not stream:  # another request made one meanwhile: use it
            stream.close()
        return racing

    @property
    def colocated(self) -> bool:
        return self.prefill is None

    def generate(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        emit: Emit,
        is_cancelled: Callable[[], bool],
        usage: RequestUsage | None = None,
    ) -> None:
        """Relay tokens through ``emit`` until the last; raises ServingError or Cancelled.
        ``usage`` gets what the prompt cost (its cached tokens) before the first token.

        A request whose token pipeline failed it after admission (a lost stage with no
        replica to resume from, a lost head) runs again from its prompt, on a pipeline
        that serves, until ``timeout_s`` after the first failure: the client sees a pause
        and no token twice (greedy and seeded decoding make the same tokens again)."""
        sent: list[int] = []
        held: list[int] = []  # without streaming, everything goes out in the last response
        held_log_probs: list[TokenLogProb] = []  # held's, if the request asked
        made = 0  # tokens this attempt made so far

        def relay(tokens: list[int], log_probs: list[TokenLogProb] | None, final: bool) -> None:
            nonlocal made
            repeats = max(0, len(sent) + len(held) - made)  # a rerun's repeats go
            made += len(tokens)
            held.extend(tokens[repeats:])
            if params.return_log_probs:
                log_probs = log_probs or []
                if len(log_probs) != len(tokens):  # a node that lost them: never silently
                    raise Refused(f"{len(tokens)} tokens came with {len(log_probs)} log-probs")
                held_log_probs.extend(log_probs[repeats:])
            if not (final or params.stream and len(held) >= (self.stream_interval if sent
                                                                else 1)):
                return
            # A stream that fell behind gets every token it waits for in one response.
            emit(list(held), list(held_log_probs) if params.return_log_probs else None,
                 sent[-CONTEXT_TOKENS:], final)
            sent.extend(held)
            held.clear()
            held_log_probs.clear()

        with self._seat(is_cancelled):  # the rest wait here: no storm of reserve retries
            lost_at: float | None = None
            busy_until = time.monotonic() + self.timeout_s
            busy_wait, rerun_wait = _BUSY_WAIT_S, self.rerun_wait_s
            attempt = _Attempt()
            while True:
                made = 0
                if is_cancelled():
                    raise Cancelled()
                try:
                    if attempt.request_id is not None and (sent or held):
                        made = len(sent) + len(held)  # its tokens from here on are new
                        self._reattach(attempt, prompt_ids, params, sent + held, relay,
                                       is_cancelled)
                        return
                    return self._generate_once(prompt_ids, params, relay, is_cancelled,
                                               usage or RequestUsage(), attempt)
                except NotKept as exc:
                    log.warning("%s; running the request again from its prompt", exc)
                    self.metrics.rerun("request")
                    attempt.request_id = None
                except NodeBusy:
                    if time.monotonic() + busy_wait > busy_until:
                        raise
                    if self.decode.has_room():  # another pipeline has a slot: go there now
                        continue
                    # Admitted requests give their slots back within a step; a failed one's
                    # slot waits out a late writer: back off.
                    self._wait(busy_wait, is_cancelled)
                    busy_wait = min(2 * busy_wait, _MAX_BUSY_WAIT_S)
                except Refused:
                    raise
                except (ServingError, NoNodeError) as exc:
                    if lost_at is None and isinstance(exc, ServingError) and not isinstance(
                            exc, PipelineLost):
                        raise  # refused before any pipeline took it: not a fault
                    lost_at = lost_at or time.monotonic()
                    if time.monotonic() + rerun_wait - lost_at > self.timeout_s:
                        raise ServingError(f"{exc} (and still failing {self.timeout_s:.0f} s "
                                           "after the first failure)") from exc
                    if attempt.request_id is not None and (sent or held):
                        log.warning("%s; re-attaching the request once its pipeline is "
                                    "repaired", exc)
                        # Until a head takes over (``_reattach`` then waits for the repair's
                        # end) or the lost one is back.
                        self._wait(rerun_wait, is_cancelled, self._head_back(attempt))
                        continue
                    log.warning("%s; running the request again from its prompt in %.1f s", exc,
                                rerun_wait)
                    self.metrics.rerun("request")
                    # A pipeline or P-node that comes back meanwhile ends the wait: no backoff
                    # left to sit out once the supervisor has started a lost pipeline afresh.
                    self._wait(rerun_wait, is_cancelled, self._revived_since())
                    rerun_wait = min(2 * rerun_wait, _MAX_RERUN_WAIT_S)

    @contextlib.contextmanager
    def _seat(self, is_cancelled: Callable[[], bool]) -> Iterator[None]:
        """One of ``max_sequences`` seats, held while the sequence runs; the wait ends
        with NodeBusy after ``timeout_s`` or Cancelled when the client leaves."""
        if self.seats is None:
            yield
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.seats.acquire(timeout=CANCEL_POLL_S):
            if is_cancelled() or self.stopped.is_set():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise NodeBusy(f"every one of the {self.max_sequences} sequence seats still "
                               f"taken after {self.timeout_s:.0f} s")
        try:
            yield
        finally:
            self.seats.release()

    def _head_back(self, attempt: _Attempt) -> Callable[[], bool]:
        """Whether another node has taken the attempt's head over (a spare), or a node of
        either pool came back, since this call."""
        revived = self._revived_since()
        return lambda: revived() or self._head_moved(attempt)

    def _head_moved(self, attempt: _Attempt) -> bool:
        return self.head_at.get(attempt.url, attempt.url) != attempt.head_at

    def _revived_since(self) -> Callable[[], bool]:
        """Whether a node of either pool came back since this call."""
        def revivals() -> int:
            return self.decode.revivals + (self.prefill.revivals if self.prefill else 0)

        now = revivals()
        return lambda: revivals() != now

    def _wait(self, seconds: float, is_cancelled: Callable[[], bool],
              ready: Callable[[], bool] = lambda: False) -> None:
        """Sleep before a retry; a client that leaves meanwhile ends it at once, and
        ``ready()`` ends it early."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if is_cancelled() or self.stopped.is_set():
                raise Cancelled()
            if ready():
                return
            time.sleep(min(left, 0.05))

    def _generate_once(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        relay: Relay,
        is_cancelled: Callable[[], bool],
        usage: RequestUsage,
        attempt: _Attempt,
    ) -> None:
        """One try: route, hand the prompt from P to T, relay tokens. Raises PipelineLost
        if the pipeline fails the request after admitting it (``attempt`` says where it
        was admitted: a lost head's replacement may take it back)."""
        request_id = uuid.uuid4().hex
        # Pending tokens this request holds on the T-node: those it may generate, and when
        # colocated its prompt's until the first token (the prefill runs there: routing by
        # outputs alone piled 2,000-token prompts onto some nodes: 4% less served, simulated).
        left, prompt = params.max_tokens, len(prompt_ids) if self.colocated else 0
        url, charged = self.decode.route(left + prompt, self._hashes(self.decode, prompt_ids,
                                                                     params),
                                         None if self.colocated else len(prompt_ids))
        prompt = charged - left  # kv: the prompt tokens it will compute there

        def counted(tokens: list[int], log_probs: list[TokenLogProb] | None,
                    final: bool) -> None:
            nonlocal left, prompt
            self.decode.done(url, min(left, len(tokens)) + prompt)
            left, prompt = left - min(left, len(tokens)), 0
            relay(tokens, log_probs, final)

        stream: RequestStream | None = None
        done = admitted = False
        reserved: list[str] = []  # later stages holding a slot stage 0 has not taken over

        def admit(rid: str) -> tuple[RequestStream, np.ndarray | None]:
            return self._admit(url, rid, prompt_ids, params, reserved, is_cancelled)

        try:
            asked = time.perf_counter()
            stream, tickets = admit(request_id)
            admitted = True
            if not self.colocated:
                self.metrics.leg("admission", time.perf_counter() - asked)
                try:
                    first = self._prefill(request_id, prompt_ids, params, tickets, is_cancelled)
                except PrefillLost as lost:
                    log.warning("%s; running the prompt again on another P-node", lost)
                    self.metrics.rerun("prompt")
                    stream.end()  # the head frees the slot on every stage
                    stream.close()
                    stream, admitted = None, False
                    request_id = uuid.uuid4().hex
                    stream, tickets = admit(request_id)
                    admitted = True
                    first = self._prefill(request_id, prompt_ids, params, tickets, is_cancelled)
                tokens, log_probs, usage.cached_tokens = first
                attempt.url, attempt.request_id = url, request_id
                attempt.head_at = self.head_at.get(url, url)
                counted(tokens, log_probs, False)
            self._follow(url, stream, counted, is_cancelled, usage)
            done = True
        except (InferenceServerException, ControlError) as exc:
            if isinstance(exc, ControlError):  # the head answered: it lives, and dropped it
                attempt.request_id = None
            if is_unreachable(exc):
                self.decode.mark_down(url)
            error = _decode_error(exc, f"decode node {url}", admitted)
            if isinstance(error, NodeBusy):
                self.decode.mark_full(url, _MAX_BUSY_WAIT_S)
            raise error from exc
        except NodeBusy:  # a later stage refused its slot
            self.decode.mark_full(url, _MAX_BUSY_WAIT_S)
            raise
        except (PipelineLost, Refused, Cancelled):
            raise
        except (ServingError, StreamTimeout, ConnectionError) as exc:
            if admitted:  # e.g. the P-node failed, or stage 0 went silent
                raise PipelineLost(str(exc)) from exc
            if isinstance(exc, ServingError):
                raise
            raise ServingError(str(exc)) from exc
        finally:
            if stream is not None:
                stream.stop_forwarding()  # no token in flight on the feed's thread after this
            self.decode.done(url, left + prompt)
            self.decode.leave(url)
            if stream is not None:
                if not done:  # the client left, or it failed here: the node drops it
                    stream.end()
                stream.close()
            for stage_url in reserved:  # a stage gone took its slot along
                with contextlib.suppress(InferenceServerException, ControlError, TimeoutError):
                    self.control.call(stage_url, "release", request_id=request_id)

    def _follow(self, url: str, stream: RequestStream, relay: Relay,
                is_cancelled: Callable[[], bool], usage: RequestUsage) -> None:
        """Relay the request's tokens from ``url`` until its last. They go out from the feed's
        thread as they come; this one waits for the last ones (no thread woken per token)."""
        stream.forward(lambda tokens, log_probs: relay(tokens, log_probs, False))
        done = False
        while not done:
            tokens, log_probs, done = stream.tokens(is_cancelled)
            if self.colocated:  # the node's last response says it
                usage.cached_tokens = stream.cached_tokens
            if done and stream.kv_events is not None:  # before the client hears the end
                self._index_kv_events(self.decode, url, stream.kv_events)
            relay(tokens, log_probs, done)

    def _reattach(self, attempt: _Attempt, prompt_ids: list[int], params: GenerationParams,
                  delivered: list[int], relay: Relay, is_cancelled: Callable[[], bool]) -> None:
        """Hand a request whose head was lost to the head of the same pipeline, once the
        controller has closed its repair, with the tokens its client has (``delivered``);
        its tokens from there on go to ``relay``. Raises NotKept if the head kept nothing
        of it, PipelineLost if it cannot be reached or fails it again."""
        url, deadline = attempt.url, time.monotonic() + self.timeout_s
        while not self.decode.is_up(url):  # marked down from its loss to its repair's end
            if not self._head_moved(attempt):  # no spare took over: it starts afresh
                raise NotKept(f"pipeline {url} is down and no node took its head over")
            if time.monotonic() > deadline:
                raise PipelineLost(f"pipeline {url} not repaired in {self.timeout_s:.0f} s")
            self._wait(_REPAIR_POLL_S, is_cancelled)
        assert attempt.request_id is not None
        stream: RequestStream | None = None
        done = False
        left = params.max_tokens - len(delivered)
        self.decode.hold(url, left)
        try:
            stream = self._node_stream(url).open(attempt.request_id, self.timeout_s)
            stream.send(request_arrays(prompt_ids, replace(params, delivered=tuple(delivered))))
            self._follow(url, stream, relay, is_cancelled, RequestUsage())
            done = True
            self.metrics.reattached()
        except ControlError as exc:
            if exc.code is ErrorCode.NOT_KEPT:
                raise NotKept(str(exc)) from exc
            raise PipelineLost(f"re-attaching to {url}: {exc}") from exc
        except (InferenceServerException, ServingError, StreamTimeout, ConnectionError) as exc:
            if isinstance(exc, Refused):
                raise
            if isinstance(exc, InferenceServerException) and is_unreachable(exc):
                self.decode.mark_down(url)  # its replacement marks it up
            raise PipelineLost(f"re-attaching to {url}: {exc}") from exc
        finally:
            self.decode.done(url, left)
            self.decode.leave(url)
            if stream is not None:
                stream.stop_forwarding()
                if not done:
                    stream.end()
                stream.close()

    def _admit(
        self, url: str, request_id: str, prompt_ids: list[int], params: GenerationParams,
        reserved: list[str], is_cancelled: Callable[[], bool],
    ) -> tuple[RequestStream, np.ndarray | None]:
        """Reserve the prompt KV on every stage and send the request to stage 0; the KV
        tickets (None when colocated). ``reserved`` lists the stages to release if this
        fails."""
        if self.prefill is not None:
            # No P-node to write its KV: a slot taken now would wait out a writer that never
            # comes (the T-node cannot tell), and hold its place from the reruns.
            self.prefill.check_live()
        tickets = []
        for stage_url in [] if self.colocated else self.later_stages[url]:
            tickets.append(self._reserve(stage_url, request_id, prompt_ids))
            reserved.append(stage_url)
        stream = self._node_stream(url).open(request_id, self.timeout_s)
        try:
            stream.send(request_arrays(prompt_ids, params) | self._kv_since(self.decode, url))
            if self.colocated:
                return stream, None
            ticket = stream.next(is_cancelled).as_numpy("kv_ticket")
            if ticket is None:
                raise ServingError(f"decode node {url} answered without a KV ticket")
        except BaseException:
            stream.end()
            stream.close()
            raise
        reserved.clear()  # stage 0 holds the request now: its head frees every slot
        return stream, np.concatenate([ticket.reshape(-1), np.array(tickets, np.object_)])

    def _reserve(self, url: str, request_id: str, prompt_ids: list[int]) -> bytes:
        try:
            return self.control.call(url, "reserve", request_id=request_id,
                                     prompt_ids=prompt_ids)
        except (InferenceServerException, ControlError, TimeoutError) as exc:
            raise _decode_error(exc, f"decode node {url} (a later stage)", admitted=False
                                ) from exc

    def _prefill(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams,
        tickets: np.ndarray, is_cancelled: Callable[[], bool],
    ) -> tuple[list[int], list[TokenLogProb] | None, int]:
        """The first token, its log-prob if the request asked, the prompt's cached tokens.
        A client that leaves meanwhile ends the wait; the call is not cancelled (Triton 2.51
        races a cancellation against a response): the T-side ``end`` marks the request's KV
        slot ended, which the P-node reads, and it stops after the layer in progress."""
        assert self.prefill is not None
        with self.prefill.assign(len(prompt_ids),
                                 self._hashes(self.prefill, prompt_ids, params)) as url:
            address = self.prefill_at[url]  # where its role is served now
            arrays = {**request_arrays(prompt_ids, params), "kv_ticket": tickets,
                      **self._kv_since(self.prefill, url)}
            answers: queue.Queue = queue.Queue()
            asked = time.perf_counter()
            try:
                self.prefill_clients[url].async_infer(
                    "prefill", [tensor(k, v) for k, v in arrays.items()],
                    lambda result, error: answers.put((result, error)),
                    request_id=request_id, client_timeout=self.timeout_s,
                    parameters=request_parameters(self.secret, "prefill", "prefill", request_id,
                                                  address, arrays),
                )
                while True:
                    try:
                        result, error = answers.get(timeout=CANCEL_POLL_S)
                        break
                    except queue.Empty:
                        if is_cancelled():
                            raise Cancelled() from None
                if error is not None:
                    raise error
                raise_for_error(result, f"prefill node {address}")
            except InferenceServerException as exc:
                if is_unreachable(exc):  # died before or during the call: worth a rerun
                    self.prefill.mark_down(url)
                    # A fresh channel: this one backs off reconnecting to the dead node and
                    # fails calls at once until its next try, after the node is back too.
                    self.prefill_clients[url] = connect(address)
                    raise PrefillLost(f"prefill node {address} lost: {exc.message()}") from exc
                # Prefill is deterministic: it would fail the same way again.
                raise Refused(f"prefill node {address}: {exc.message()}") from exc
            except ControlError as exc:
                if exc.code is ErrorCode.KV_TRANSFER:  # its KV never landed: worth a rerun
                    self.prefill.mark_down(url)
                    raise PrefillLost(str(exc)) from exc
                raise Refused(str(exc)) from exc
            self.metrics.leg("prefill_call", time.perf_counter() - asked)
            events = result.as_numpy("kv_events")
            if events is not None:
                self._index_kv_events(self.prefill, url, events.reshape(-1)[0])
            cached = result.as_numpy("cached_tokens")
            return ([int(result.as_numpy("output_ids")[0])], _log_probs(result),
                    0 if cached is None else int(cached[0]))


    # -- KV-aware routing (the router of the nodes that prefill) -----------------------

    @staticmethod
    def _hashes(router: Router, prompt_ids: list[int], params: GenerationParams) -> list[int]:
        """The prompt's prefix-cache block hashes, where ``router`` routes by them."""
        if router.policy != "kv":
            return []
        return block_hashes(prompt_ids, router.block_tokens, params.cache_salt)

    @staticmethod
    def _kv_since(router: Router, url: str) -> dict[str, np.ndarray]:
        """The request's ``kv_since`` input: the node answers with its KV events since."""
        if router.policy != "kv":
            return {}
        return {"kv_since": np.array([router.kv_cursor(url).encode()], np.object_)}

    def _index_kv_events(self, router: Router, url: str, blob: bytes) -> None:
        """A node's KV events into ``router``'s index; events not signed with the cluster
        secret are dropped (never the request)."""
        try:
            router.kv_events(url, decode_events(self.secret, blob))
        except (Unauthenticated, ValueError, KeyError, TypeError) as exc:
            log.warning("dropped the KV events of %s: %s", url, exc)


def _log_probs(result: grpcclient.InferResult) -> list[TokenLogProb] | None:
    """A node's response's log-probs (None: the request did not ask for them)."""
    data = result.as_numpy("log_probs")
    return None if data is None else decode_log_probs(data.reshape(-1)[0])
