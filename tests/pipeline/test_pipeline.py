"""Token pipelines end to end on a tiny model: token-exact against the single-process reference
with early stops and refills, swapping within its arena budget, cancel, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages
from orchestrator.engine.torch_engine import load_engine
from orchestrator.layout import StageSpec
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.pipeline.sequence import FinishReason, Sequence

MAX_SEQ = 96
# Different limits, more requests than slots: sequences stop early and are replaced mid-run.
LIMITS = [3, 11, 1, 14, 6, 8, 2, 9]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gpt2")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 24, (len(LIMITS),), generator=g).tolist()
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(model, prompts):
    engines = load_stages(model, 1, max_seq_len=MAX_SEQ)
    return [generate(engines, [p], m)[0] for p, m in zip(prompts, LIMITS, strict=True)]


@pytest.fixture(scope="module")
def eos_id(reference):
    """A token the reference emits mid-way through a long output: eos early stops happen."""
    return reference[3][4]


def pipeline_of(engines, batch: int, prompt_engines=None, **config) -> LocalPipeline:
    """The stages' nodes in this process; ``config``: PipelineConfig fields."""
    return LocalPipeline(engines, PipelineConfig(depth=len(engines), batch_size=batch, **config),
                         prompt_engines=prompt_engines)


def make_pipeline(model, depth: int, mode: str, swap: str, **config) -> LocalPipeline:
    engines = load_stages(model, depth, max_seq_len=MAX_SEQ)
    prompt = load_stages(model, 1, max_seq_len=MAX_SEQ) if mode == "disaggregated" else None
    config.setdefault("num_microbatches", max(depth, 2))
    return pipeline_of(engines, 2, prompt, mode=mode, swap=swap, **config)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("swap", ["off", "on"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_token_exact_with_early_stops(model, prompts, reference, eos_id, depth, swap, mode):
    expected = [
        generate(load_stages(model, 1, max_seq_len=MAX_SEQ), [p], m, eos_id)[0]
        for p, m in zip(prompts, LIMITS, strict=True)
    ]
    assert any(out[-1] == eos_id and len(out) < m for out, m in zip(expected, LIMITS, strict=True))
    with make_pipeline(model, depth, mode, swap) as pipeline:
        assert pipeline.generate(prompts, LIMITS, timeout_s=60) == reference
        assert pipeline.generate(prompts, LIMITS, eos_id, timeout_s=60) == expected
        for arena in pipeline.arenas:
            assert arena.peak_bytes <= arena.budget_bytes
    assert pipeline.kv_held() == 0
    assert all(arena.used_bytes == 0 for arena in pipeline.arenas)


@pytest.mark.parametrize("swap", ["off", "on"])
@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_is_token_exact(model, prompts, reference, depth, swap):
    """Prompts of 2-23 tokens in chunks of a 3-token step budget (with token steps in it):
    most run over several steps, on top of the KV their earlier chunks left."""
    with make_pipeline(model, depth, "colocated", swap, prefill_chunk=3) as pipeline:
        assert pipeline.generate(prompts, LIMITS, timeout_s=60) == reference
    assert pipeline.kv_held() == 0


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(("chunk", "swap"), [(0, "off"), (3, "off"), (3, "on")],
                         ids=["whole prompts", "chunks of 3", "chunks of 3, swapping"])
def test_a_prefix_cache_reuses_each_turns_prefix_token_exact(model, chunk, swap, depth):
    """Colocated with a prefix cache of 4-token blocks (its index on the head, each stage's
    layers in its pool): each turn's prompt is the last one, its answer and a new message.
    Its first chunk starts after the blocks the last turn stored (once its whole prompt was
    in), and with chunks the budget pays only for the rest; the tokens are the reference's
    and ``cached_tokens`` names exactly those blocks."""
    block, limit = 4, 5
    engines = load_stages(model, 1, max_seq_len=MAX_SEQ)
    turns, prompt = [], [(7 * i + 3) % 400 + 4 for i in range(10)]
    for message in ([9, 8, 7, 6, 5], [11] * 7, None):
        answer = generate(engines, [prompt], limit)[0]
        turns.append((prompt, answer))
        if message is not None:
            prompt = prompt + answer + message
    pipeline = make_pipeline(model, depth, "colocated", swap, prefill_chunk=chunk)
    reuse = pipeline.reuse_prefixes(block, capacity_blocks=64)
    with pipeline:
        previous: list[int] = []
        for turn, (prompt, answer) in enumerate([*turns, turns[-1]]):  # the last, repeated
            seq = pipeline.submit(Sequence(f"turn{turn}", prompt, limit))
            pipeline.wait(60)
            assert seq.output_ids == answer
            assert seq.cached_tokens == min(len(previous), len(prompt) - 1) // block * block
            assert len(reuse.cache) == len(prompt) // block  # every turn's prompt, a prefix
            previous = prompt
        assert reuse.cache.in_use() == {} and reuse.cache.stats.hit_tokens > 0
    assert pipeline.kv_held() == 0


def test_swapping_holds_two_microbatches_on_the_device(model, prompts, reference):
    """Three microbatches through two stages; each stage's arena holds 2 x batch slots and
    prefetches the next microbatch while the current one computes."""
    with make_pipeline(model, 2, "disaggregated", "on", num_microbatches=3) as pipeline:
        assert pipeline.generate(prompts, LIMITS, timeout_s=60) == reference
    for arena, kv in zip(pipeline.arenas, pipeline.kv, strict=True):
        assert arena.budget_bytes == 2 * 2 * arena.slot_bytes
        assert 0 < arena.peak_bytes <= arena.budget_bytes
        # misses are first steps (nothing to prefetch yet); the rest was fetched ahead
        assert kv.prefetched > kv.swapped_on_demand
        assert kv.written_back_bytes > 0


def test_resident_batch_that_does_not_fit_the_budget_is_refused(model):
    engines = load_stages(model, 2, max_seq_len=MAX_SEQ)
    slot = engines[0].kv_layout.slot_bytes()
    with pytest.raises(ValueError, match="needs 4 slots"):
        pipeline_of(engines, 2, swap="off", device_kv_budget=3 * slot)
    # the same budget fits batch 2 when swapping (2 microbatches x 2 would not)
    pipeline_of(engines, 2, swap="on", device_kv_budget=4 * slot).stop()
    # auto keeps KV resident when it fits
    assert not pipeline_of(engines, 1, swap="auto", device_kv_budget=3 * slot).swap
    with pytest.raises(ValueError, match="swap_workload"):
        pipeline_of(engines, 2, swap="auto", device_kv_budget=3 * slot)
    # auto swaps when not even one sequence per microbatch fits resident (4 > 3 slots)
    assert pipeline_of(engines, 1, num_microbatches=4, swap="auto", device_kv_budget=3 * slot,
                       swap_workload=(16, 8)).swap
    # otherwise it measures step time and copy bandwidth and applies the Appendix E rule; a
    # tiny model's 1 KB per token per stage comes back in microseconds, under one step
    assert pipeline_of(engines, 2, num_microbatches=3, swap="auto", device_kv_budget=5 * slot,
                       swap_workload=(16, 8)).swap


def test_explicit_layer_map(model, prompts, reference):
    specs = StageSpec.split(4, 2, [1, 3])
    assert [(s.first_layer, s.last_layer) for s in specs] == [(0, 1), (1, 4)]
    engines = [load_engine(model, s, max_seq_len=MAX_SEQ) for s in specs]
    with pipeline_of(engines, 3, mode="colocated") as pipeline:
        assert pipeline.generate(prompts, LIMITS, timeout_s=60) == reference
    with pytest.raises(ValueError, match="do not split"):
        StageSpec.split(4, 2, [1, 2])


def test_llama_gqa_disaggregated_prompt_stages_differ_from_token_stages(tiny_model):
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    limits = [5, 2, 7]
    ref_engines = load_stages(model, 1, max_seq_len=MAX_SEQ)
    expected = [generate(ref_engines, [p], m)[0] for p, m in zip(prompts, limits, strict=True)]
    # prompt pipeline split 1+3, token pipeline 2+1+1: KV regrouped on the way
    prompt_engines = load_stages(model, 2, layers=[1, 3], max_seq_len=MAX_SEQ)
    engines = load_stages(model, 3, layers=[2, 1, 1], max_seq_len=MAX_SEQ)
    with pipeline_of(engines, 1, prompt_engines, swap="on") as pipeline:
        assert pipeline.generate(prompts, limits, timeout_s=60) == expected


def test_tokens_stream_through_callbacks_in_order(model, prompts, reference):
    seen: dict[str, list[int]] = {}
    finished: list[str] = []

    def on_token(seq: Sequence, token: int | None, done: bool) -> None:
        if token is not None:
            seen.setdefault(seq.request_id, []).append(token)
        if done:
            finished.append(seq.request_id)

    with make_pipeline(model, 2, "disaggregated", "off") as pipeline:
        for i, (p, m) in enumerate(zip(prompts, LIMITS, strict=True)):
            pipeline.submit(Sequence(f"r{i}", p, m, on_token=on_token))
        pipeline.wait(60)
    assert [seen[f"r{i}"] for i in range(len(prompts))] == reference
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(prompts)))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_cancel_frees_kv(model, mode):
    names = ["long0", "long1", "long2", "queued"]  # 3 running (2 microbatches x 2), 1 waiting
    cancelled = threading.Event()

    def on_token(seq: Sequence, token: int | None, done: bool) -> None:
        # a client hanging up mid-stream: cancel everything from the token callback
        if seq.request_id == "long0" and len(seq.output_ids) == 3 and not cancelled.is_set():
            cancelled.set()
            assert all(pipeline.cancel(name) for name in names)

    with make_pipeline(model, 2, mode, "on") as pipeline:
        seqs = [pipeline.submit(Sequence(n, [4, 5, 6], 80, on_token=on_token)) for n in names]
        pipeline.wait(30)
        assert cancelled.is_set() and not pipeline.cancel("unknown")
        # the stages free the KV when the cancelled sequences' microbatches step next
        deadline = time.monotonic() + 10
        while pipeline.kv_held() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipeline.kv_held() == 0
        assert all(arena.used_bytes == 0 for arena in pipeline.arenas)
    assert all(s.finish_reason is FinishReason.CANCELLED for s in seqs)
    assert seqs[0].output_ids and len(seqs[0].output_ids) == 3
    assert all(len(s.output_ids) < 80 for s in seqs)


class FailingEngine:
    """A real stage whose third token step raises or stalls (isolates the error paths)."""

    def __init__(self, engine, stall_s: float = 0.0) -> None:
        self._engine, self._calls, self._stall_s = engine, 0, stall_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, prompts, prompt_caches, inputs, caches):
        self._calls += inputs is not None
        if self._calls == 3 and inputs is not None:
            if not self._stall_s:
                raise RuntimeError("injected decode failure")
            time.sleep(self._stall_s)
        return self._engine.step(prompts, prompt_caches, inputs, caches)


def test_a_failing_stage_ends_requests_with_its_error_and_frees_kv(model, prompts):
    engines = load_stages(model, 2, max_seq_len=MAX_SEQ)
    engines[1] = FailingEngine(engines[1])
    with pipeline_of(engines, 2, mode="colocated", swap="on") as pipeline:
        with pytest.raises(RuntimeError, match="stage 1: injected decode failure"):
            pipeline.generate(prompts, LIMITS, timeout_s=30)
        assert pipeline.errors
    assert pipeline.kv_held() == 0


def test_bad_requests_are_refused_with_a_reason(model):
    with make_pipeline(model, 1, "colocated", "off") as pipeline:
        with pytest.raises(ValueError, match="exceed max_seq_len"):
            pipeline.submit(Sequence("big", [1] * 90, 10))
        pipeline.submit(Sequence("dup", [1, 2], 40))
        with pytest.raises(ValueError, match="already running"):
            pipeline.submit(Sequence("dup", [1, 2], 4))
        pipeline.wait(30)
    engines = load_stages(model, 2, max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match="chain"):
        pipeline_of(engines[::-1], 1)
    with pytest.raises(ValueError, match="swap"):
        pipeline_of(engines, 1, swap="maybe")
    with pytest.raises(ValueError, match="submit_prefilled"), pipeline_of(engines, 1) as p:
        p.submit(Sequence("x", [1], 2))


def test_a_stalled_stage_times_out_instead_of_hanging(model, prompts):
    engines = load_stages(model, 2, max_seq_len=MAX_SEQ)
    engines[0] = FailingEngine(engines[0], stall_s=1.5)
    pipeline = pipeline_of(engines, 2, mode="colocated", step_timeout_s=0.3)
    with pipeline, pytest.raises(RuntimeError, match="got no answer in 0.3 s"):
        pipeline.generate(prompts, LIMITS, timeout_s=30)
