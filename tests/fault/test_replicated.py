"""Recovery on an in-process pipeline of stage nodes: a stage is killed mid-run, the
controller (a process) detects it, a hot spare takes its slot and the T-nodes' own four
steps restore it; outputs are token-exact."""

from __future__ import annotations

import pytest
import torch
from replicated_pipeline import Kill, ReplicatedPipeline

from orchestrator.engine.reference import generate, load_stages, log_softmax_along
from orchestrator.engine.sampling import SamplingParams
from orchestrator.pipeline.local import LocalPipeline
from orchestrator.pipeline.node import PipelineConfig
from orchestrator.pipeline.sequence import FinishReason, Sequence

MAX_SEQ = 64
# More requests than slots, different lengths: microbatches are refilled mid-run.
LIMITS = [12, 5, 14, 9, 3, 12, 7, 10]


def make_prompts(seed: int = 0, shared: int = 0) -> list[list[int]]:
    """``shared``: a system prompt of that many tokens before each."""
    g = torch.Generator().manual_seed(seed)
    system = list(range(7, 7 + shared))
    return [system + torch.randint(4, 500, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 12, (len(LIMITS),), generator=g)]


def reference(model, prompts) -> list[list[int]]:
    engines = load_stages(str(model), 1, max_seq_len=MAX_SEQ)
    return [generate(engines, [p], m)[0] for p, m in zip(prompts, LIMITS, strict=True)]


def config(depth: int, **fields) -> PipelineConfig:
    """Two sequences per microbatch; a lost stage pauses the head for a repair. Silence
    counts only after the controller's own timeout would have (it decides)."""
    return PipelineConfig(depth, 2, recover_timeout_s=60.0, dead_after_s=30.0, **fields)


def run(controller: str, model, depth: int, kills: list[Kill], name: str, swap: str = "off",
        replicate: bool = True, mode: str = "colocated", prompts: list[list[int]] | None = None,
        prefix_block: int = 0):
    """Returns (outputs, finish events per request, the wrapper, replicas left) once every
    request ended. Disaggregated, an in-process P-side prefills. ``prompts``: default
    :func:`make_prompts`; ``prefix_block``: a prefix cache of blocks of that many tokens."""
    engines = load_stages(str(model), depth, max_seq_len=MAX_SEQ)
    prompt = load_stages(str(model), 1, max_seq_len=MAX_SEQ) if mode != "colocated" else None
    pipeline = LocalPipeline(engines, config(depth, mode=mode, swap=swap), prompt_engines=prompt)
    if prefix_block:
        pipeline.reuse_prefixes(prefix_block, capacity_blocks=64)
    ft = ReplicatedPipeline(pipeline, controller, name, replicate=replicate, kills=kills,
                            heartbeat_s=0.03)
    finishes: dict[str, int] = {}

    def on_token(seq: Sequence, token: int | None, finished: bool) -> None:
        finishes[seq.request_id] = finishes.get(seq.request_id, 0) + finished

    # Log-probs asked for: a recovery redoes them with the tokens.
    seqs = [Sequence(f"r{i}", p, m, on_token=on_token, sampling=SamplingParams(log_probs=True))
            for i, (p, m) in enumerate(zip(prompts or make_prompts(), LIMITS, strict=True))]
    with ft:
        for seq in seqs:
            pipeline.submit(seq)
        pipeline.wait(60)
        held = ft.replicas_held()
        assert pipeline.kv_held() == 0
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs), [s.error for s in seqs]
    assert not ft.kills, "a kill never fired"
    return [s.output_ids for s in seqs], finishes, ft, held, [s.log_probs for s in seqs]


def assert_reference_log_probs(model, outputs, log_probs) -> None:
    """Each log-prob the pipeline made (disaggregated, the P-side's first token's went to
    the client) is the reference model's log-softmax at its position."""
    engines = load_stages(str(model), 1, max_seq_len=MAX_SEQ)
    for prompt, ids, got in zip(make_prompts(), outputs, log_probs, strict=True):
        rows = log_softmax_along(engines, prompt, ids)
        made = [(i, p.log_prob) for i, p in enumerate(got) if p is not None]
        assert len(made) >= len(ids) - 1
        want = [float(rows[i, ids[i]]) for i, _ in made]
        assert [p for _, p in made] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("arch", "depth", "swap", "mode", "kill"),
    [("gpt2", 3, "off", "colocated", Kill(stage=1, microbatch=0, step=6)),
     # the last stage's holder is stage 0; prompts prefilled by an in-process P-side
     ("llama", 2, "off", "disaggregated", Kill(stage=1, microbatch=1, step=5)),
     ("opt", 3, "on", "colocated", Kill(stage=2, microbatch=2, step=4)),  # last stage, swap
     ("gpt2", 3, "on", "disaggregated", Kill(stage=1, microbatch=1, step=8))],
)
def test_recovery_on_the_token_pipeline_is_token_exact(controller, tiny_model, arch, depth,
                                                       swap, mode, kill) -> None:
    model = tiny_model(arch)
    outputs, finishes, ft, held, log_probs = run(controller, model, depth, [kill],
                                                 f"tp-{arch}-{mode}", swap, mode=mode)
    assert outputs == reference(model, make_prompts())
    assert_reference_log_probs(model, outputs, log_probs)
    assert finishes == {f"r{i}": 1 for i in range(len(LIMITS))}  # none lost, none twice
    (recovery,) = ft.recoveries
    assert recovery.stages == [kill.stage] and not recovery.recompute
    # Settled: every step before the kill was replicated, so exactly the killed one is redone.
    assert recovery.resume[kill.microbatch] == kill.step
    # The last stage ran every step of that microbatch once: no prompt ran again.
    steps = [step for mb, step, _ in ft.steps_done if mb == kill.microbatch]
    assert kill.step in steps and len(steps) == len(set(steps))
    assert held == 0  # every replica freed as its request ended


def test_unsettled_kill_redoes_no_later_step_and_stays_exact(controller, tiny_model) -> None:
    model = tiny_model("gpt2")
    kill = Kill(stage=2, microbatch=1, step=7, settled=False)
    outputs, finishes, ft, held, _ = run(controller, model, 3, [kill], "tp-unsettled")
    assert outputs == reference(model, make_prompts())
    assert set(finishes.values()) == {1}
    (recovery,) = ft.recoveries
    assert recovery.resume[1] <= 7 and held == 0  # never past the kill


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_holder_also_lost_falls_back_to_recompute(controller, tiny_model, mode) -> None:
    """Colocated, the prompts run again in the pipeline; disaggregated, the P-side
    prefills them again."""
    model = tiny_model("gpt2")
    kill = Kill(stage=1, microbatch=0, step=4, also=(2,))  # stage 2 holds stage 1's replicas
    outputs, finishes, ft, held, log_probs = run(controller, model, 3, [kill],
                                                 f"tp-fallback-{mode}", mode=mode)
    assert outputs == reference(model, make_prompts())
    assert_reference_log_probs(model, outputs, log_probs)
    assert set(finishes.values()) == {1}
    (recovery,) = ft.recoveries
    assert recovery.recompute and recovery.stages == [1, 2] and recovery.restarted > 0
    assert held == 0


@pytest.mark.parametrize("kill", [Kill(stage=1, microbatch=0, step=6),
                                  Kill(stage=1, microbatch=0, step=4, also=(2,))],
                         ids=["from replicas", "holder also lost: recompute"])
def test_recovery_with_a_prefix_cache_is_token_exact(controller, tiny_model, kill) -> None:
    """Colocated, prompts after an 8-token system prompt, a prefix cache of 4-token blocks
    (the head's index, each stage's pool): later prompts load the shared blocks. A spare's
    pool is empty, so the repair drops the whole index (no hit names a block it lacks),
    and the outputs stay the reference's."""
    model = tiny_model("gpt2")
    prompts = make_prompts(shared=8)
    outputs, finishes, ft, held, _ = run(controller, model, 3, [kill], f"tp-prefix-{kill.step}",
                                         prompts=prompts, prefix_block=4)
    assert outputs == reference(model, prompts)
    assert set(finishes.values()) == {1} and held == 0
    (recovery,) = ft.recoveries
    assert recovery.stages == [1, *kill.also]
    assert ft.pipeline.nodes[0].prefix.cache.stats.hit_tokens > 0


def test_restart_from_scratch_baseline_is_token_exact(controller, tiny_model) -> None:
    model = tiny_model("gpt2")
    kill = Kill(stage=2, microbatch=0, step=6)
    outputs, finishes, ft, held, _ = run(controller, model, 3, [kill], "tp-restart",
                                         replicate=False)
    assert outputs == reference(model, make_prompts())
    assert set(finishes.values()) == {1}
    (recovery,) = ft.recoveries
    assert recovery.recompute and recovery.restarted > 0 and held == 0
    steps = [step for mb, step, _ in ft.steps_done if mb == 0]
    assert steps.count(0) == 2  # microbatch 0 started over from its prompts


def test_bad_setups_are_named(controller, tiny_model) -> None:
    model = str(tiny_model("gpt2"))
    two = LocalPipeline(load_stages(model, 2, max_seq_len=MAX_SEQ), config(2, mode="colocated"))
    with pytest.raises(ValueError, match="stages 1..1 of a depth-2 pipeline"):
        ReplicatedPipeline(two, controller, "bad", kills=[Kill(stage=5, microbatch=0, step=1)])
    with pytest.raises(ValueError, match="stage 0 holds the head"):
        ReplicatedPipeline(two, controller, "bad", kills=[Kill(stage=0)])
    one = LocalPipeline(load_stages(model, 1, max_seq_len=MAX_SEQ), config(1, mode="colocated"))
    with pytest.raises(ValueError, match="replication needs depth >= 2"):
        ReplicatedPipeline(one, controller, "bad")
    two.stop()
    one.stop()
