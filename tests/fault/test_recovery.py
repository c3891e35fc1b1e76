"""Replication and recovery, token-exact, on in-process stages with the controller as a process."""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.reference import generate, load_stages
from orchestrator.fault.drill import Drill, DrillConfig, Kill
from orchestrator.fault.replication import ReplicaStore, Replicator
from orchestrator.kv.transport.local import LocalFabric, LocalTransport

MAX_SEQ = 64
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21], [22]]


def reference(model, max_tokens: int) -> dict[str, list[int]]:
    out = generate(load_stages(str(model), 1, max_seq_len=MAX_SEQ), PROMPTS, max_tokens)
    return {f"r{i}": tokens for i, tokens in enumerate(out)}


def drill_run(controller: str, model, depth: int, kills: list[Kill], pipeline: str,
              replicate: bool = True, max_tokens: int = 12):
    engines = load_stages(str(model), depth, max_seq_len=MAX_SEQ)
    # 6 prompts, 2 microbatches of 2: the third microbatch refills a finished one.
    config = DrillConfig(controller, depth, microbatch_size=2, num_microbatches=2,
                         max_tokens=max_tokens, replicate=replicate, pipeline=pipeline,
                         heartbeat_s=0.03)
    drill = Drill(config, engines)
    try:
        return drill.run(PROMPTS, kills)
    finally:
        drill.close()


@pytest.mark.parametrize(
    ("arch", "depth", "kill"),
    [("gpt2", 3, Kill(step=6, stage=1, microbatch=0)),
     ("llama", 2, Kill(step=5, stage=1, microbatch=1)),  # the holder of stage 1 is stage 0
     ("opt", 3, Kill(step=3, stage=0, microbatch=2))],  # in the refilled microbatch
)
def test_recovery_from_replicas_is_token_exact(controller, tiny_model, arch, depth, kill) -> None:
    model = tiny_model(arch)
    result = drill_run(controller, model, depth, [kill], f"exact-{arch}")
    assert result.outputs == reference(model, 12)
    (recovery,) = result.recoveries
    assert recovery.stages == [kill.stage] and not recovery.recompute
    # No prompt recomputed: the killed microbatch resumes from a replicated step.
    assert recovery.resume[kill.microbatch] >= 1
    redone = [s for s, _ in result.step_done[kill.microbatch]]
    assert redone.count(0) == 1
    assert result.replicas_held_after == 0  # freed as requests ended


def test_unsettled_kill_loses_in_flight_acks_but_stays_exact(controller, tiny_model) -> None:
    model = tiny_model("gpt2")
    kill = Kill(step=7, stage=2, microbatch=1, settled=False)
    result = drill_run(controller, model, 3, [kill], "unsettled")
    assert result.outputs == reference(model, 12)
    (recovery,) = result.recoveries
    assert recovery.resume[1] <= 7  # never beyond the kill point


def test_neighbour_also_dead_falls_back_to_recompute(controller, tiny_model) -> None:
    model = tiny_model("gpt2")
    kills = [Kill(step=4, stage=1), Kill(step=4, stage=2)]  # stage 2 holds stage 1's replica
    result = drill_run(controller, model, 3, kills, "fallback")
    assert result.outputs == reference(model, 12)
    (recovery,) = result.recoveries
    assert recovery.recompute and recovery.stages == [1, 2]
    assert set(recovery.resume.values()) == {0}
    assert result.replicas_held_after == 0


def test_restart_from_scratch_baseline_is_token_exact(controller, tiny_model) -> None:
    model = tiny_model("gpt2")
    result = drill_run(controller, model, 3, [Kill(step=6, stage=2)], "restart",
                       replicate=False)
    assert result.outputs == reference(model, 12)
    (recovery,) = result.recoveries
    assert recovery.recompute and recovery.resume[0] == 0
    assert [s for s, _ in result.step_done[0]].count(0) == 2  # the prompt ran twice


def test_replica_follows_the_source_and_is_freed(tiny_model) -> None:
    """The holder's replica equals the stage's own KV after each acked step."""
    (engine,) = load_stages(str(tiny_model("gpt2")), 1, max_seq_len=MAX_SEQ)
    fabric = LocalFabric()
    source, holder = LocalTransport(fabric, "src"), LocalTransport(fabric, "holder")
    source.add_peer("holder", holder.metadata())
    acks: list[tuple[int, int, int]] = []
    store = ReplicaStore(holder, engine.kv_layout, 4, b"s", lambda *a: acks.append(a))
    replicator = Replicator(0, source, engine.kv_layout, b"s", store, max_batch=2)
    caches = [engine.new_cache(), engine.new_cache()]
    logits = engine.prefill([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], caches)
    replicator.step(7, 0, ["a", "b"], caches)
    tokens = torch.stack(logits).argmax(-1)
    for step in range(1, 6):
        tokens = engine.decode(tokens, caches).argmax(-1)
        replicator.step(7, step, ["a", "b"], caches)
        store.progress()
    replicator.flush()
    assert acks[-1] == (0, 7, 5) and [a[2] for a in acks] == sorted(a[2] for a in acks)
    for rid, cache in zip("ab", caches, strict=True):
        n = cache.length
        assert torch.equal(store.replica(rid, n).data[:, :, :, :n], cache.data[:, :, :, :n])
    with pytest.raises(RuntimeError, match="holds 8 positions, 9 needed"):
        store.replica("a", 9)
    replicator.remove("a")
    replicator.remove("b")
    replicator.flush()
    assert store.held == [] and store.held_bytes() == 0
    replicator.close()


def test_bad_drill_config_is_named() -> None:
    with pytest.raises(ValueError, match="replication needs depth >= 2"):
        DrillConfig("127.0.0.1:1", 1, 1, 1, 4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        DrillConfig("127.0.0.1:1", 2, 1, 1, 0)
