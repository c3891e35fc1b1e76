"""The head of a token pipeline: scheduling, token callbacks, early-stop refill, admission.

The head owns the :class:`~orchestrator.pipeline.scheduler.MicrobatchScheduler`.
It sends each microbatch's next step into ``to_first`` (the first stage's
inbox), gets the step's tokens back from ``from_last`` (the last stage's
outbox), hands every request its tokens through its callback, and refills the
slots of requests that stopped early. It never touches an engine or KV, so
it runs the same on node 0 of a pipeline whose stages are other processes
(:class:`~orchestrator.pipeline.node.StageNode`) as in one process
(:class:`~orchestrator.pipeline.local.LocalPipeline`).

Admission of requests prefilled elsewhere: ``submit_prefilled(seq)`` without a
first token parks the request; the head sends a
:class:`~orchestrator.pipeline.link.KVProbe` down the pipeline, and each stage
keeps only the requests whose prompt KV it holds complete. The probe rides on
every step issued while requests wait (each stage answers it after the step's
layers), so a prompt whose KV landed during a step joins the next one; alone
only while no step is in flight (a probe queued behind a step came back after
that microbatch's next step was issued: every request joined a step late, on
a decode step's time). When the probe comes back, the head admits those every
stage has (with the first token the
prompt worker put in the transfer's ``extra``), fails those a stage reports
failed, and fails with the stage's name those still missing after
``kv_timeout_s``. Prompt KV that will never be used (cancel, failure) is
released on every stage by the next probe.

Faults (:class:`HeadState`): a stage that reports it cannot send on, or that
``health()`` finds dead, *breaks* the pipeline: every request in it ends with
that error, and new submissions are refused; with ``recover_timeout_s`` the
head is *faulted* instead, its requests wait for a repair: the fault-tolerance layer
calls the head's ``pause``, ``rewind`` and ``resume`` in the order that
:mod:`orchestrator.fault.stage_recovery` describes.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from orchestrator.control.errors import ErrorCode
from orchestrator.pipeline.link import (
    KVProbe,
    Link,
    LinkTimeout,
    Shutdown,
    StepMessage,
    TokenMessage,
)
from orchestrator.pipeline.scheduler import Batch, MicrobatchScheduler
from orchestrator.pipeline.sequence import FinishReason, Status, ids_after
from orchestrator.pipeline.sequence import Sequence as Seq

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
ERRORS_KEPT = 64  # the latest errors a long-lived head keeps (``error_count`` counts all)


class NotKept(KeyError):
    """Nothing of a request to re-attach is kept here: it runs again from its prompt."""

    error_code = ErrorCode.NOT_KEPT


class HeadState(enum.Enum):
    """What the head does with work. SERVING -> PAUSED (``pause``: a repair is under way)
    or FAULTED (a stage is lost; paused until a repair ``resume`` s it or
    ``recover_timeout_s`` passes) -> SERVING (``resume``); any -> BROKEN (every request
    failed, new ones refused; final)."""

    SERVING = "serving"
    PAUSED = "paused"
    FAULTED = "faulted"
    BROKEN = "broken"


class PipelineHead:
    def __init__(
        self,
        to_first: Link,
        from_last: Link,
        *,
        num_microbatches: int,
        batch_size: int,
        max_seq_len: int,
        mode: str = "disaggregated",
        step_timeout_s: float = 60.0,
        kv_timeout_s: float = 30.0,
        probe_interval_s: float = 0.001,
        poll_s: float = 0.005,
        health: Callable[[], str | None] | None = None,
        recover_timeout_s: float | None = None,
        prefill_chunk: int = 0,
    ) -> None:
        """``health()``: None while every stage is alive, else what is wrong (checked each loop).
        ``kv_timeout_s``: how long a prefilled request may wait for its KV on every stage.
        ``recover_timeout_s``: a stage failure pauses the head (requests stay) for a repair
        to ``resume`` it within this long, else it breaks; None: it breaks at once.
        ``prefill_chunk``: colocated, a step's token budget (chunked prefill); 0: whole
        prompts."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.to_first, self.from_last, self.mode = to_first, from_last, mode
        self.num_microbatches, self.batch_size = num_microbatches, batch_size
        self.scheduler = MicrobatchScheduler(num_microbatches, batch_size, mode == "colocated",
                                             prefill_chunk)
        self.max_seq_len = max_seq_len
        self.step_timeout_s, self.kv_timeout_s = step_timeout_s, kv_timeout_s
        self.probe_interval_s, self.poll_s = probe_interval_s, poll_s
        self.health = health
        self.recover_timeout_s = recover_timeout_s
        # Prefilled elsewhere, a request whose prompt KV a failed stage lost: whoever can
        # prefill it again (an in-process P-side) takes it; None: it ends with an error and
        # the frontend runs it again.
        self.prefill_again: Callable[[Seq], None] | None = None
        # A pipeline of one stage in this process: runs that stage's pending steps on the
        # head's thread, outside its lock (None: the stages run on threads of their own).
        self.run_stage: Callable[[], None] | None = None
        # After each step's tokens were handed out and its microbatch's next step issued,
        # on the head's thread (a T-node sends the step's tokens on in one message).
        self.on_step: Callable[[], None] | None = None

        self._lock = threading.RLock()
        self._done = threading.Condition(self._lock)
        self._live: dict[str, Seq] = {}
        self._in_flight = [False] * num_microbatches
        self._sent_step = [-1] * num_microbatches
        self._sent_at = [0.0] * num_microbatches
        # Prefilled elsewhere, KV not yet confirmed on every stage: seq id -> (seq, since).
        self._pending_kv: dict[int, tuple[Seq, float]] = {}
        self._waiting_at: dict[int, int] = {}  # seq id -> first stage the last probe missed
        self._unreleased: dict[int, str] = {}  # prompt KV to drop on every stage
        self._probe_sent_at: float | None = None
        self._last_probe = 0.0
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        self.error_count = 0
        self.state = HeadState.SERVING
        self.reason: str | None = None  # why FAULTED (since ``_fault_at``) or BROKEN
        self._fault_at = 0.0
        self._markers: dict[str, bool] = {}  # drain marker sent -> came back
        # A lost head's requests whose KV the stages kept, until the frontend re-attaches
        # them: request id -> (seq id, KV length); dropped after ``kv_timeout_s``.
        self._reattachable: dict[str, tuple[int, int]] = {}
        self._reattachable_since = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipeline-head", daemon=True)
        self._started = False
        self._generate_ids = itertools.count()

    @property
    def broken(self) -> str | None:
        """Why the pipeline is down for good (None: it is not)."""
        return self.reason if self.state is HeadState.BROKEN else None

    @property
    def fault(self) -> str | None:
        """Why the head is paused waiting for a repair (None: it is not)."""
        return self.reason if self.state is HeadState.FAULTED else None

    @property
    def _paused(self) -> bool:
        return self.state in (HeadState.PAUSED, HeadState.FAULTED)

    def _error(self, error: str) -> None:
        self.errors.append(error)
        self.error_count += 1

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> PipelineHead:
        self._thread.start()
        self._started = True
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the head, then the stages (a Shutdown passes through each); requests still
        running end with an error."""
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        self._thread.join(timeout_s)
        # A broken pipeline cannot pass the Shutdown all the way: stop what can be reached.
        wait_s = timeout_s if self.broken is None else min(timeout_s, 0.5)
        deadline = time.monotonic() + wait_s
        try:
            self.to_first.send(Shutdown(), wait_s)
            # Drain answers until the shutdown comes out, never waiting past the deadline.
            while (left := deadline - time.monotonic()) > 0:
                if self.run_stage is not None and not self._thread.is_alive():
                    self.run_stage()
                if isinstance(self.from_last.recv(min(self.poll_s, left)), Shutdown):
                    break
        except (LinkTimeout, ConnectionError) as exc:
            log.warning("pipeline stop: %s", exc)
        with self._lock:
            self._fail_everything("pipeline stopped")

    def __enter__(self) -> PipelineHead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests (any thread) ---------------------------------------------------------

    def submit(self, seq: Seq) -> Seq:
        """A new prompt: colocated pipelines run it in a microbatch step."""
        if self.mode != "colocated":
            raise ValueError("this pipeline has no prompt engines: use submit_prefilled")
        with self._lock:
            self._register(seq)
            self.scheduler.add(seq)
        self.from_last.wake()  # an idle loop issues it now, not after its poll
        return seq

    def submit_prefilled(self, seq: Seq, first_token: int | None = None) -> Seq:
        """A request whose prompt was prefilled elsewhere (``mode='disaggregated'``).

        ``first_token`` given: its prompt KV is known to be on every stage already.
        Without it, the head waits until every stage reports the KV complete, and
        takes the first token from the prompt worker's ``extra``."""
        if self.mode != "disaggregated":
            raise ValueError("prefilled requests need mode='disaggregated'")
        with self._lock:
            self._register(seq)
            if first_token is None:
                self._pending_kv[seq.seq_id] = (seq, time.monotonic())
            else:
                self._admit_prefilled(seq, first_token)
        self.from_last.wake()
        return seq

    def expect_reattach(self, kept: dict[str, tuple[int, int]]) -> None:
        """Recovery of a lost head, on its replacement: the stages hold ``kept`` (request id
        -> (seq id, KV length)) for the frontend to :meth:`reattach`."""
        with self._lock:
            self._reattachable = dict(kept)
            self._reattachable_since = time.monotonic()
            if kept:  # the new head's sequences take other ids: the stages' KV keys
                ids_after(max(s for s, _ in kept.values()))

    def reattach(self, seq: Seq, delivered: Sequence[int]) -> Seq:
        """Take back a lost head's request (``seq``: as first submitted; ``delivered``: the
        tokens its client has) on the KV the stages kept: it goes on from the KV length
        both hold, and tokens made again after it are the ones delivered (greedy or
        seeded). Raises NotKept if nothing of it was kept here."""
        if self.mode != "disaggregated":
            raise ValueError("re-attaching needs mode='disaggregated'")
        with self._lock:
            kept = self._reattachable.pop(seq.request_id, None)
            if kept is None:
                raise NotKept(f"request {seq.request_id!r}: no KV kept here to re-attach")
            seq.seq_id, length = kept
            tokens = min(length - seq.prompt_len + 1, len(delivered))  # the last one: input
            if tokens < 1:
                self._release_kept([seq.seq_id])
                raise NotKept(f"request {seq.request_id!r}: {length} KV positions kept, "
                               f"{len(delivered)} tokens delivered: nothing to go on from")
            self._register(seq)
            seq.output_ids, seq.log_probs = list(delivered[:tokens]), [None] * tokens
            seq.kv_kept = seq.prompt_len + tokens - 1
            seq.status = Status.READY
            self.scheduler.add(seq)
        self.from_last.wake()
        return seq

    def cancel(self, request_id: str) -> bool:
        """End a request now; its KV is freed by its microbatch's next step (or next probe)."""
        with self._lock:
            seq = self._live.get(request_id)
            if seq is None:
                return False
            # READY (or pending): its prompt KV waits on the stages. RUNNING: the stages hold
            # it (and may not have taken it yet), so only its microbatch's next step frees it.
            pending = self._pending_kv.pop(seq.seq_id, None) is not None
            unadmitted = pending or seq.status is Status.READY
            if self.scheduler.cancel(request_id) is None:
                seq.finish(FinishReason.CANCELLED)  # e.g. mid-prefill: dropped when it returns
            if unadmitted:
                self._discard_prompt_kv(seq)
                self.from_last.wake()  # the next probe releases its prompt KV
            self._prune()
            return True

    def wait(self, timeout_s: float) -> None:
        """Until every submitted request has ended."""
        with self._done:
            if not self._done.wait_for(lambda: not self._live, timeout_s):
                stuck = ", ".join(sorted(self._live)[:5])
                raise TimeoutError(f"{len(self._live)} requests unfinished after {timeout_s} s "
                                   f"({stuck}); pipeline errors: {list(self.errors)[-3:]}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int],
        eos_id: int | None = None,
        timeout_s: float = 120.0,
        submit: Callable[[Seq], Seq] | None = None,
    ) -> list[list[int]]:
        """Submit prompts (``max_tokens`` one for all or one each, through ``submit``:
        default :meth:`submit`) and wait for the outputs."""
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(limits)} max_tokens")
        seqs = [Seq(f"gen-{next(self._generate_ids)}", list(p), m, eos_id)
                for p, m in zip(prompts, limits, strict=True)]
        for seq in seqs:
            (submit or self.submit)(seq)
        self.wait(timeout_s)
        failed = [s for s in seqs if s.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
        return [s.output_ids for s in seqs]

    def report_failure(self, error: str) -> None:
        """A stage cannot go on (its next stage is gone): wait for a repair (with
        ``recover_timeout_s``), else fail everything and refuse new work."""
        with self._lock:
            self._fault(error)

    # -- fault recovery ---------------------------------------------------------------

    def give_up(self, error: str) -> None:
        """A repair failed: break now (every request ends with ``error``; the frontend runs
        them again elsewhere) rather than hold them until ``recover_timeout_s``."""
        with self._lock:
            self._break(error)

    def pause(self) -> None:
        """Issue nothing more; answers still coming back are taken in."""
        with self._lock:
            if self.state is HeadState.SERVING:
                self.state = HeadState.PAUSED

    def drain(self, link: Link, timeout_s: float) -> None:
        """Wait until every message ahead of a marker sent into ``link`` reached the head:
        after it, nothing downstream of ``link`` is in flight (paused head, in-process)."""
        # A probe releasing nothing real (no seq id is negative) passes every stage as is.
        marker = f"drain-{next(self._generate_ids)}"
        with self._lock:
            self._markers[marker] = False
        link.send(KVProbe({}, release={-1: marker}), timeout_s)
        with self._done:
            drained = self._done.wait_for(lambda: self._markers[marker], timeout_s)
            del self._markers[marker]
        if not drained:
            raise TimeoutError(f"the pipeline did not drain in {timeout_s} s")

    def rewind(self, resume: dict[int, int], prompt_kv_lost: bool = False) -> dict[int, int]:
        """Paused: microbatch j redoes from step ``min(resume.get(j, 0), first step the head
        has no answer for)``. Cuts tokens from there on, queues again the sequences that
        joined later; returns every running sequence's KV length before its redo step.
        ``prompt_kv_lost`` (a stage was replaced): prompt KV prefilled elsewhere and not yet
        taken into a microbatch went with the stage, so those requests start over too."""
        lengths: dict[int, int] = {}
        restarted: list[Seq] = []
        with self._lock:
            if not self._paused:
                raise RuntimeError("rewind needs a paused head")
            for mb in range(self.num_microbatches):
                answered = self._sent_step[mb] if self._in_flight[mb] else self.scheduler.steps[mb]
                kept, lost = self.scheduler.rewind(mb, min(resume.get(mb, 0), answered))
                lengths |= kept
                restarted += lost
                self._in_flight[mb] = False
            if prompt_kv_lost and self.mode != "colocated":
                for seq in self.scheduler.waiting:  # admitted: it has its first token
                    seq.truncate(0)
                    seq.status = Status.WAITING
                restarted += [*self.scheduler.waiting, *(s for s, _ in self._pending_kv.values())]
                self.scheduler.waiting.clear()
                self._pending_kv.clear()
            for seq in reversed(restarted):  # ahead of the waiting queue, in their old order
                self._restart(seq)
            if self.scheduler.prefix is not None:  # a replaced stage keeps no cached block
                self.scheduler.prefix.reset()
            self._probe_sent_at = None  # a KV probe in flight may have died too: probe again
        return lengths

    def resume(self) -> None:
        """Go on: every microbatch not in flight takes its next step now."""
        with self._lock:
            if self.state is HeadState.BROKEN:
                return
            self.state, self.reason = HeadState.SERVING, None
            for mb, busy in enumerate(self._in_flight):
                if not busy:
                    self._issue(mb)
        self.from_last.wake()  # a stage run on the head's thread takes them now

    def running(self) -> list[Seq]:
        """The sequences holding a microbatch slot now."""
        with self._lock:
            return [s for batch in self.scheduler.running for s in batch]

    def _restart(self, seq: Seq) -> None:
        """A sequence whose prompt KV was lost starts over: colocated, its prompt runs
        again; prefilled elsewhere, only if ``prefill_again`` can prefill it."""
        if self.mode == "colocated":
            self.scheduler.waiting.appendleft(seq)
        elif self.prefill_again is not None:
            self._pending_kv[seq.seq_id] = (seq, time.monotonic())
            self.prefill_again(seq)
        else:
            seq.finish(FinishReason.ERROR, f"request {seq.request_id!r}: prompt KV lost with "
                                           "a failed stage; prefill it again")
            self._discard_prompt_kv(seq)  # what the surviving stages hold of it

    def _discard_prompt_kv(self, seq: Seq) -> None:
        """Its prompt KV will never be taken: the next probe releases it on every stage."""
        self._unreleased[seq.seq_id] = seq.request_id

    # -- the loop -------------------------------------------------------------------

    def _register(self, seq: Seq) -> None:
        if not self._started:
            raise RuntimeError("pipeline not started")
        if self.broken is not None:
            raise RuntimeError(f"pipeline is down: {self.broken}")
        if seq.request_id in self._live:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        if seq.prompt_len + seq.max_tokens - 1 > self.max_seq_len:
            raise ValueError(f"request {seq.request_id!r}: {seq.prompt_len} prompt tokens + "
                             f"{seq.max_tokens} new exceed max_seq_len {self.max_seq_len}")
        self._live[seq.request_id] = seq

    def _admit_prefilled(self, seq: Seq, first_token: int) -> None:
        with self._lock:
            if not seq.is_finished:  # not cancelled while its prompt ran
                seq.append(first_token)  # the first token counts (and may end it)
            if seq.is_finished:
                self._discard_prompt_kv(seq)
            else:
                seq.status = Status.READY
                self.scheduler.add(seq)
            self._prune()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                if self.broken is None and not self._paused:
                    if self.scheduler.waiting:
                        for mb, busy in enumerate(self._in_flight):
                            if not busy:
                                self._issue(mb)
                    self._probe()
            if self.run_stage is not None:
                self.run_stage()
            message = self.from_last.recv(self._wait_s())
            with self._lock:
                if self.broken is None:
                    if isinstance(message, TokenMessage):
                        self._complete(message)
                    elif isinstance(message, KVProbe) and message.release.get(-1) in self._markers:
                        self._markers[message.release[-1]] = True
                        self._done.notify_all()
                    elif isinstance(message, KVProbe):
                        self._probe_sent_at = None
                        self._probed(message)
                    self._check_health()
                    if not self._paused:  # a paused head waits on a repair, not a stall
                        self._fail_stalled()
                    self._expire_pending_kv()
                    self._expire_reattachable()
                self._prune()

    def _wait_s(self) -> float:
        """How long to wait for an answer: until the next probe alone is due while prompts
        wait for their KV and no step is in flight to carry it (an idle node's second token
        then waits for its admission ~0.5 ms, not ~``poll_s`` / 2), else ``poll_s``."""
        with self._lock:
            if not (self._pending_kv or self._unreleased) or not self._may_probe_alone():
                return self.poll_s
            due = self._last_probe + self.probe_interval_s - time.monotonic()
        return min(self.poll_s, max(0.0, due))

    def _issue(self, mb: int) -> None:
        batch = self.scheduler.schedule(mb)
        if batch.is_empty:
            return
        message = _to_message(batch)
        message.probe = self._next_probe()
        try:
            self.to_first.send(message, self.step_timeout_s)
        except LinkTimeout as exc:
            if message.probe is not None:
                self._unreleased |= message.probe.release
            self._error(str(exc))
            self.scheduler.fail(mb, f"first stage not taking work: {exc}")
            return
        self._in_flight[mb], self._sent_step[mb] = True, batch.step
        for seq in batch.admit:  # its KV was cut to this length on every stage
            seq.kv_kept = None
        self._sent_at[mb] = time.monotonic()

    def _complete(self, message: TokenMessage) -> None:
        mb = message.microbatch
        if not self._in_flight[mb] or message.step != self._sent_step[mb]:
            log.warning("dropping a late answer for microbatch %d step %d", mb, message.step)
            return
        if message.error is not None and self.fault is not None:
            log.warning("microbatch %d step %d failed while the pipeline waits for a repair: "
                        "%s (redone after it)", mb, message.step, message.error)
            return  # left in flight, unanswered: ``rewind`` redoes it
        self._in_flight[mb] = False
        if message.error is not None:
            self._error(message.error)
            self.scheduler.fail(mb, message.error)
        else:
            self.scheduler.postprocess(mb, message.tokens, message.log_probs)
        if message.probe is not None:  # before the next step is issued: they join it
            self._probed(message.probe)
        if not self._paused:
            self._issue(mb)
        if self.on_step is not None:
            self.on_step()

    # -- admission of requests prefilled elsewhere ------------------------------------------

    def _next_probe(self) -> KVProbe | None:
        """A probe for every pending request and release (None: nothing to ask)."""
        if not (self._pending_kv or self._unreleased):
            return None
        probe = KVProbe({s: seq.request_id for s, (seq, _) in self._pending_kv.items()},
                        release=self._unreleased)
        self._unreleased = {}
        return probe

    def _may_probe_alone(self) -> bool:
        """No probe alone is out, and no step is in flight to carry one."""
        return self._probe_sent_at is None and not any(self._in_flight)

    def _probe(self) -> None:
        """A probe alone while no step is in flight to carry one; one at a time."""
        now = time.monotonic()
        if not self._may_probe_alone() or now - self._last_probe < self.probe_interval_s:
            return
        if (probe := self._next_probe()) is None:
            return
        try:
            self.to_first.send(probe, self.step_timeout_s)
        except LinkTimeout as exc:
            self._unreleased |= probe.release
            self._error(f"first stage not taking a KV probe: {exc}")
            return
        self._probe_sent_at = self._last_probe = now

    def _probed(self, probe: KVProbe) -> None:
        self._waiting_at = probe.waiting_at
        for seq_id, token in probe.ready.items():
            # gone if cancelled or timed out while the probe was out (its release is queued)
            pending = self._pending_kv.pop(seq_id, None)
            if pending is not None:
                self._admit_prefilled(pending[0], token)
        for seq_id, error in probe.failed.items():
            pending = self._pending_kv.pop(seq_id, None)
            if pending is not None:
                pending[0].finish(FinishReason.ERROR, error)
                self._discard_prompt_kv(pending[0])

    def _expire_pending_kv(self) -> None:
        now = time.monotonic()
        for seq_id, (seq, since) in list(self._pending_kv.items()):
            if now - since > self.kv_timeout_s:
                stage = self._waiting_at.get(seq_id)
                where = "any stage" if stage is None else f"stage {stage}"
                del self._pending_kv[seq_id]
                seq.finish(FinishReason.ERROR, f"prompt KV of {seq.request_id!r} not complete "
                                               f"on {where} after {self.kv_timeout_s} s")
                self._discard_prompt_kv(seq)

    def _expire_reattachable(self) -> None:
        """Kept KV that no frontend re-attached within ``kv_timeout_s`` is freed."""
        if self._reattachable and (time.monotonic() - self._reattachable_since
                                   > self.kv_timeout_s):
            log.warning("%d requests of a lost head not re-attached in %s s: their KV freed",
                        len(self._reattachable), self.kv_timeout_s)
            self._release_kept([s for s, _ in self._reattachable.values()])
            self._reattachable.clear()

    def _release_kept(self, seq_ids: list[int]) -> None:
        """Free these sequences' KV on every stage with microbatch 0's next step."""
        self.scheduler.to_release[0].extend(seq_ids)
        if not self._in_flight[0] and not self._paused:
            self._issue(0)

    # -- faults ---------------------------------------------------------------------

    def _check_health(self) -> None:
        problem = self.health() if self.health is not None else None
        if problem is not None:
            self._fault(problem)
        if self.fault is not None and time.monotonic() - self._fault_at > self.recover_timeout_s:
            self._break(f"{self.fault}; not repaired within {self.recover_timeout_s} s")

    def _fault(self, error: str) -> None:
        """A stage is lost: pause for a repair if one may come, else break."""
        if self.recover_timeout_s is None or self.broken is not None:
            self._break(error)
        elif self.state is not HeadState.FAULTED:
            log.error("pipeline paused, waiting for a repair: %s", error)
            self.state, self.reason, self._fault_at = HeadState.FAULTED, error, time.monotonic()
            self._error(error)

    def _fail_stalled(self) -> None:
        now = time.monotonic()
        for mb, busy in enumerate(self._in_flight):
            if busy and now - self._sent_at[mb] > self.step_timeout_s:
                error = (f"microbatch {mb} step {self._sent_step[mb]} got no answer in "
                         f"{self.step_timeout_s} s")
                self._error(error)
                self._in_flight[mb] = False
                self.scheduler.fail(mb, error)
        if self._probe_sent_at is not None and now - self._probe_sent_at > self.step_timeout_s:
            self._error(f"a KV probe got no answer in {self.step_timeout_s} s")
            self._probe_sent_at = None  # probe again; pending requests time out on their own

    def _break(self, error: str) -> None:
        if self.state is not HeadState.BROKEN:
            log.error("pipeline down: %s", error)
            self.state, self.reason = HeadState.BROKEN, error
            self._error(error)
        self._fail_everything(error)

    def _fail_everything(self, error: str) -> None:
        self._in_flight = [False] * self.num_microbatches
        self._probe_sent_at = None
        self._pending_kv.clear()
        for seq in list(self._live.values()):
            seq.finish(FinishReason.ERROR, error)
            self._discard_prompt_kv(seq)
        self.scheduler.clear()
        self._prune()

    def _prune(self) -> None:
        for request_id in [r for r, s in self._live.items() if s.is_finished]:
            del self._live[request_id]
        if not self._live:
            self._done.notify_all()


def _to_message(batch: Batch) -> StepMessage:
    decode_ids = [s.seq_id for s in batch.decode]
    inputs = torch.tensor([s.last_token for s in batch.decode]) if batch.decode else None
    sampled = [c.seq for c in batch.prefill if c.completes] + batch.admit
    return StepMessage(
        microbatch=batch.microbatch,
        step=batch.step,
        seq_ids=decode_ids,
        inputs=inputs,
        prompt_seq_ids=[c.seq.seq_id for c in batch.prefill],
        prompts=[torch.tensor(c.ids) for c in batch.prefill],
        cached_blocks={c.seq.seq_id: c.load for c in batch.prefill if c.load},
        store_blocks={c.seq.seq_id: c.store for c in batch.prefill if c.store},
        partial=[c.seq.seq_id for c in batch.prefill if not c.completes],
        admit=[s.seq_id for s in batch.admit],
        resume={s.seq_id: s.kv_kept for s in batch.admit if s.kv_kept is not None},
        release=batch.release,
        # The last stage's samplers go on after the tokens made (the P-node's first).
        sampling={s.seq_id: s.sampling.resumed(s.output_ids) for s in sampled},
    )
