"""The token pipeline: D stage workers, microbatches in flight, one head that schedules.

``TokenPipeline`` is what a T-node runs (depth 1: one node; depth D: D nodes
with the links crossing processes). The head owns the
:class:`~orchestrator.pipeline.scheduler.MicrobatchScheduler`: it sends each
microbatch's next step to the first stage, gets the step's tokens back from
the last, hands every request its tokens through its callback, and refills
the slots of requests that stopped early. ``mode="colocated"`` is the
baseline: prompts enter the same pipeline and run inside microbatch steps.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from orchestrator.engine.base import Engine, StageSpec
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.torch_engine import TorchEngine, load_engine
from orchestrator.pipeline.link import (
    Link,
    LinkTimeout,
    QueueLink,
    Shutdown,
    StepMessage,
    TokenMessage,
)
from orchestrator.pipeline.prompt_worker import PromptKVStore, PromptWorker
from orchestrator.pipeline.scheduler import Batch, MicrobatchScheduler
from orchestrator.pipeline.sequence import FinishReason, Status
from orchestrator.pipeline.sequence import Sequence as Seq
from orchestrator.pipeline.stage import Interval, PromptKVSource, StageWorker
from orchestrator.pipeline.swapper import (
    SWAP_MODES,
    DeviceArena,
    KVPlacement,
    ResidentKV,
    SwappedKV,
    measure_copy_bandwidth,
    should_swap,
)

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")


def stage_specs(
    num_layers: int, depth: int | None = None, layers: Sequence[int] | None = None
) -> list[StageSpec]:
    """An even split into ``depth`` stages, or explicit layer counts per stage."""
    if layers is None:
        return StageSpec.split(num_layers, depth or 1)
    if depth is not None and depth != len(layers):
        raise ValueError(f"depth {depth} but {len(layers)} layer counts {list(layers)}")
    if sum(layers) != num_layers or min(layers) < 1:
        raise ValueError(f"layer counts {list(layers)} do not split {num_layers} layers")
    bounds = [0, *torch.tensor(list(layers)).cumsum(0).tolist()]
    return [StageSpec(a, b, num_layers) for a, b in zip(bounds, bounds[1:], strict=False)]


def load_pipeline_engines(
    model_dir: str | Path,
    depth: int | None = None,
    layers: Sequence[int] | None = None,
    **engine_kwargs,
) -> list[TorchEngine]:
    """One engine per stage of :func:`stage_specs` (``engine_kwargs`` go to ``load_engine``)."""
    num_layers = ModelConfig.from_dir(model_dir).num_layers
    return [load_engine(model_dir, spec, **engine_kwargs)
            for spec in stage_specs(num_layers, depth, layers)]


class TokenPipeline:
    def __init__(
        self,
        engines: Sequence[Engine],
        batch_size: int,
        *,
        mode: str = "disaggregated",
        num_microbatches: int | None = None,
        swap: str = "off",
        device_kv_budget: int | None = None,
        swap_workload: tuple[int, int] | None = None,
        prompt_engines: Sequence[Engine] | None = None,
        prompt_kv: PromptKVSource | None = None,
        prompt_batch: int = 4,
        step_timeout_s: float = 60.0,
        poll_s: float = 0.005,
        make_link: Callable[[str, int], Link] = QueueLink,
    ) -> None:
        """``device_kv_budget``: device KV bytes per stage (default: just what the mode needs).
        ``swap_workload``: (prompt_len, new_tokens) the ``auto`` swap rule is evaluated for.
        ``prompt_engines``: an in-process P-worker's stages (disaggregated); without them,
        prompt KV arrives from elsewhere through ``prompt_kv`` and ``submit_prefilled``.
        ``make_link(name, capacity)``: the stage-to-stage links (default in-process queues)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if swap not in SWAP_MODES:
            raise ValueError(f"swap must be one of {SWAP_MODES}, got {swap!r}")
        _check_chain(engines)
        self.engines, self.mode = list(engines), mode
        self.depth = len(engines)
        self.num_microbatches = num_microbatches or self.depth
        self.batch_size = batch_size
        self.scheduler = MicrobatchScheduler(self.num_microbatches, batch_size, mode == "colocated")
        self.max_seq_len = min(e.kv_layout.max_seq_len for e in engines)
        self.step_timeout_s, self.poll_s = step_timeout_s, poll_s

        self.swap = self._resolve_swap(swap, device_kv_budget, swap_workload)
        self.kv = [self._placement(engine, device_kv_budget) for engine in engines]

        self.prompt_store = PromptKVStore()
        self.prompt_kv: PromptKVSource = prompt_kv or self.prompt_store
        self.prompt_worker: PromptWorker | None = None
        if prompt_engines is not None:
            if prompt_kv is not None:
                raise ValueError("give prompt_engines (in-process P-worker) or prompt_kv, not both")
            if mode == "colocated":
                raise ValueError("colocated pipelines run their own prompts; drop prompt_engines")
            _check_chain(prompt_engines)
            self.prompt_worker = PromptWorker(
                prompt_engines, [e.kv_layout for e in engines], self.prompt_store,
                self._admit_prefilled, prompt_batch,
            )

        capacity = self.num_microbatches + 1  # never more messages than microbatches in flight
        self.links = [make_link(f"link-{i}", capacity) for i in range(self.depth + 1)]
        self.results = self.links[-1]
        self.stages = [
            StageWorker(i, engine, kv, self.links[i], self.links[i + 1], self.num_microbatches,
                        self.prompt_kv, send_timeout_s=step_timeout_s)
            for i, (engine, kv) in enumerate(zip(engines, self.kv, strict=True))
        ]

        self._lock = threading.RLock()
        self._done = threading.Condition(self._lock)
        self._live: dict[str, Seq] = {}
        self._in_flight = [False] * self.num_microbatches
        self._sent_step = [-1] * self.num_microbatches
        self._sent_at = [0.0] * self.num_microbatches
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._head = threading.Thread(target=self._loop, name="pipeline-head", daemon=True)
        self._started = False
        self._generate_ids = itertools.count()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> TokenPipeline:
        for stage in self.stages:
            stage.start()
        if self.prompt_worker is not None:
            self.prompt_worker.start()
        self._head.start()
        self._started = True
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every thread in order; requests still running end with an error."""
        if not self._started:
            return
        self._started = False
        self._stopping.set()
        self._head.join(timeout_s)
        if self.prompt_worker is not None:
            self.prompt_worker.stop(timeout_s)
        self.links[0].send(Shutdown(), timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # drain answers until the shutdown comes out
            if isinstance(self.results.recv(self.poll_s), Shutdown):
                break
        for stage in self.stages:
            stage.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for seq in list(self._live.values()):
                seq.finish(FinishReason.ERROR, "pipeline stopped")
                self._discard_prompt_kv(seq)
            self._prune()

    def __enter__(self) -> TokenPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests (any thread) ---------------------------------------------------------

    def submit(self, seq: Seq) -> Seq:
        """A new request: colocated, queued as a prompt; disaggregated, to the P-worker."""
        if self.mode == "disaggregated" and self.prompt_worker is None:
            raise ValueError("this pipeline has no prompt engines: use submit_prefilled")
        with self._lock:
            self._register(seq)
            if self.prompt_worker is not None:
                self.prompt_worker.submit(seq)
            else:
                self.scheduler.add(seq)
        return seq

    def submit_prefilled(self, seq: Seq, first_token: int) -> Seq:
        """A request prefilled elsewhere: its prompt KV is in ``prompt_kv`` for every stage."""
        if self.mode != "disaggregated":
            raise ValueError("prefilled requests need mode='disaggregated'")
        with self._lock:
            self._register(seq)
            self._admit_prefilled(seq, first_token)
        return seq

    def cancel(self, request_id: str) -> bool:
        """End a request now; its KV is freed by its microbatch's next step."""
        with self._lock:
            seq = self._live.get(request_id)
            if seq is None:
                return False
            # READY: its prompt KV waits in the store. RUNNING: the stages hold it (and may
            # not have taken it yet), so only its microbatch's next step frees it.
            ready = seq.status is Status.READY
            if self.scheduler.cancel(request_id) is None:
                if self.prompt_worker is not None:
                    self.prompt_worker.cancel(request_id)
                seq.finish(FinishReason.CANCELLED)  # mid-prefill: dropped when it comes back
            if ready:
                self._discard_prompt_kv(seq)
            self._prune()
            return True

    def wait(self, timeout_s: float) -> None:
        """Until every submitted request has ended."""
        with self._done:
            if not self._done.wait_for(lambda: not self._live, timeout_s):
                stuck = ", ".join(sorted(self._live)[:5])
                raise TimeoutError(f"{len(self._live)} requests unfinished after {timeout_s} s "
                                   f"({stuck}); pipeline errors: {self.errors[-3:]}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int],
        eos_id: int | None = None,
        timeout_s: float = 120.0,
    ) -> list[list[int]]:
        """Submit prompts (``max_tokens`` one for all or one each) and wait for the outputs."""
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(limits)} max_tokens")
        seqs = [Seq(f"gen-{next(self._generate_ids)}", list(p), m, eos_id)
                for p, m in zip(prompts, limits, strict=True)]
        for seq in seqs:
            self.submit(seq)
        self.wait(timeout_s)
        failed = [s for s in seqs if s.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
        return [s.output_ids for s in seqs]

    # -- what benchmarks and tests read ---------------------------------------------------

    @property
    def timelines(self) -> list[list[Interval]]:
        return [stage.timeline for stage in self.stages]

    @property
    def arenas(self) -> list[DeviceArena]:
        return [kv.arena for kv in self.kv]

    def kv_held(self) -> int:
        """Sequences whose KV any stage or the prompt store still holds."""
        return sum(len(kv) for kv in self.kv) + len(self.prompt_store)

    # -- the head -----------------------------------------------------------------

    def _register(self, seq: Seq) -> None:
        if not self._started:
            raise RuntimeError("pipeline not started")
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

    def _discard_prompt_kv(self, seq: Seq) -> None:
        if self.prompt_kv is self.prompt_store:
            self.prompt_store.discard(seq.seq_id)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                if self.scheduler.waiting:
                    for mb, busy in enumerate(self._in_flight):
                        if not busy:
                            self._issue(mb)
            message = self.results.recv(self.poll_s)
            with self._lock:
                if isinstance(message, TokenMessage):
                    self._complete(message)
                self._fail_stalled()
                self._prune()

    def _issue(self, mb: int) -> None:
        batch = self.scheduler.schedule(mb)
        if batch.is_empty:
            return
        try:
            self.links[0].send(_to_message(batch), self.step_timeout_s)
        except LinkTimeout as exc:
            self.errors.append(str(exc))
            self.scheduler.fail(mb, f"first stage not taking work: {exc}")
            return
        self._in_flight[mb], self._sent_step[mb] = True, batch.step
        self._sent_at[mb] = time.monotonic()

    def _complete(self, message: TokenMessage) -> None:
        mb = message.microbatch
        if not self._in_flight[mb] or message.step != self._sent_step[mb]:
            log.warning("dropping a late answer for microbatch %d step %d", mb, message.step)
            return
        self._in_flight[mb] = False
        if message.error is not None:
            self.errors.append(message.error)
            self.scheduler.fail(mb, message.error)
        else:
            self.scheduler.postprocess(mb, message.tokens)
        self._issue(mb)

    def _fail_stalled(self) -> None:
        now = time.monotonic()
        for mb, busy in enumerate(self._in_flight):
            if busy and now - self._sent_at[mb] > self.step_timeout_s:
                alive = [s.thread.is_alive() for s in self.stages]
                error = (f"microbatch {mb} step {self._sent_step[mb]} got no answer in "
                         f"{self.step_timeout_s} s (stage threads alive: {alive})")
                self.errors.append(error)
                self._in_flight[mb] = False
                self.scheduler.fail(mb, error)

    def _prune(self) -> None:
        for request_id in [r for r, s in self._live.items() if s.is_finished]:
            del self._live[request_id]
        if not self._live:
            self._done.notify_all()

    # -- device KV ----------------------------------------------------------------------

    def _placement(self, engine: Engine, budget: int | None) -> KVPlacement:
        """Swapping needs 2 microbatches on the device, resident KV all of them."""
        layout = engine.kv_layout
        slots = self.batch_size * (2 if self.swap else self.num_microbatches)
        budget = budget or slots * layout.slot_bytes()
        arena = DeviceArena(layout, budget, engine.device)
        if arena.capacity < slots:
            raise ValueError(
                f"stage {engine.stage}: {'swapping' if self.swap else 'resident'} KV for "
                f"batch {self.batch_size} x {self.num_microbatches} microbatches needs {slots} "
                f"slots of {layout.slot_bytes()} B; the budget {budget} B holds "
                f"{arena.capacity}" + ("" if self.swap else "; lower batch_size or swap")
            )
        return SwappedKV(arena) if self.swap else ResidentKV(arena)

    # -- swap decision ----------------------------------------------------------------

    def _resolve_swap(
        self, swap: str, budget: int | None, workload: tuple[int, int] | None
    ) -> bool:
        """``auto``: keep KV resident when it fits the budget, else apply the Appendix E rule
        with the step time and copy bandwidth measured on this machine."""
        if swap != "auto":
            return swap == "on"
        resident_slots = self.num_microbatches * self.batch_size
        if budget is None or all(budget >= resident_slots * e.kv_layout.slot_bytes()
                                 for e in self.engines):
            return False
        if workload is None:
            raise ValueError("swap='auto' over budget needs swap_workload=(prompt_len, new_tokens)")
        prompt_len, new_tokens = workload
        bandwidth = measure_copy_bandwidth(self.engines[0].device)
        for engine in self.engines:
            resident_batch = budget // engine.kv_layout.slot_bytes() // self.num_microbatches
            if resident_batch == 0:
                return True  # nothing fits without swapping
            step_time = measure_step_time(engine, resident_batch, prompt_len)
            token_bytes = engine.kv_layout.token_bytes_per_layer() * engine.kv_layout.num_layers
            if not should_swap(new_tokens, step_time, prompt_len, resident_batch, token_bytes,
                               bandwidth):
                return False
        return True


def measure_step_time(engine: Engine, batch_size: int, context_len: int, repeats: int = 3) -> float:
    """One decode step of ``batch_size`` sequences at ``context_len`` on this stage (seconds)."""
    caches = [engine.new_cache() for _ in range(batch_size)]
    best = float("inf")
    for _ in range(repeats):
        for cache in caches:
            cache.length = min(context_len, cache.layout.max_seq_len - 1)
        if engine.stage.is_first:
            inputs = torch.zeros(batch_size, dtype=torch.long)
        else:
            inputs = torch.zeros(batch_size, engine.hidden_size, device=engine.device)
        start = time.perf_counter()
        engine.decode(inputs, caches)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        best = min(best, time.perf_counter() - start)
    return best


def _to_message(batch: Batch) -> StepMessage:
    decode_ids = [s.seq_id for s in batch.decode]
    inputs = torch.tensor([s.last_token for s in batch.decode]) if batch.decode else None
    return StepMessage(
        microbatch=batch.microbatch,
        step=batch.step,
        seq_ids=decode_ids,
        inputs=inputs,
        prompt_seq_ids=[s.seq_id for s in batch.prefill],
        prompts=[torch.tensor(s.prompt_ids) for s in batch.prefill],
        admit=[s.seq_id for s in batch.admit],
        release=batch.release,
        sampling={s.seq_id: s.sampling for s in batch.prefill + batch.admit},
    )


def _check_chain(engines: Sequence[Engine]) -> None:
    """The engines must cover the model's layers in order, first to last."""
    if not engines:
        raise ValueError("no engines")
    stages = [e.stage for e in engines]
    if not stages[0].is_first or not stages[-1].is_last or any(
        a.last_layer != b.first_layer for a, b in zip(stages, stages[1:], strict=False)
    ):
        raise ValueError(f"engines do not chain the model's layers in order: {stages}")
