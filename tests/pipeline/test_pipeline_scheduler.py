"""The microbatch scheduler alone: slots, early-stop refill, release, cancel."""

from __future__ import annotations

import pytest

from orchestrator.pipeline.scheduler import MicrobatchScheduler
from orchestrator.pipeline.sequence import FinishReason, Sequence, Status


def make_seq(name: str, max_tokens: int, eos_id: int | None = None) -> Sequence:
    return Sequence(name, [1, 2, 3], max_tokens, eos_id)


def test_fills_microbatches_up_to_batch_size():
    sched = MicrobatchScheduler(num_microbatches=2, batch_size=2, colocated=True)
    seqs = [make_seq(f"r{i}", 5) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first, second = sched.schedule(0), sched.schedule(1)
    assert first.prefill == seqs[:2] and first.decode == []
    assert second.prefill == seqs[2:4]
    assert list(sched.waiting) == [seqs[4]]
    assert all(s.status is Status.RUNNING for s in seqs[:4])


def test_early_stop_refills_the_slot_and_releases_kv_at_the_next_step():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True)
    short, long, queued = make_seq("short", 1), make_seq("long", 3), make_seq("queued", 2)
    for s in (short, long, queued):
        sched.add(s)
    sched.schedule(0)
    ended = sched.postprocess(0, {short.seq_id: 7, long.seq_id: 8})
    assert ended == [short] and short.finish_reason is FinishReason.LENGTH
    batch = sched.schedule(0)
    assert batch.release == [short.seq_id]
    assert batch.decode == [long] and batch.prefill == [queued]


def test_eos_ends_a_sequence_early():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=1, colocated=False)
    seq = make_seq("r", 10, eos_id=0)
    seq.append(5)  # the first token, from a prompt worker
    sched.add(seq)
    batch = sched.schedule(0)
    assert batch.admit == [seq] and batch.decode == [seq] and batch.prefill == []
    assert sched.postprocess(0, {seq.seq_id: 0}) == [seq]
    assert seq.finish_reason is FinishReason.EOS and seq.output_ids == [5, 0]


def test_cancel_waiting_and_running():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=1, colocated=True)
    running, waiting = make_seq("a", 5), make_seq("b", 5)
    sched.add(running)
    sched.add(waiting)
    sched.schedule(0)
    assert sched.cancel("b") is waiting and not sched.waiting
    assert sched.cancel("a") is running
    # the in-flight step's token for a cancelled sequence is dropped, its KV released next step
    assert sched.postprocess(0, {running.seq_id: 4}) == [running]
    assert running.output_ids == [] and running.finish_reason is FinishReason.CANCELLED
    assert sched.schedule(0).release == [running.seq_id]
    assert sched.cancel("nobody") is None


def test_a_failed_step_ends_its_sequences_with_the_error():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True)
    seqs = [make_seq("a", 5), make_seq("b", 5)]
    for s in seqs:
        sched.add(s)
    sched.schedule(0)
    assert sched.fail(0, "stage 1: boom") == seqs
    assert all(s.error == "stage 1: boom" for s in seqs)
    assert sched.schedule(0).release == [s.seq_id for s in seqs]


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="batch_size"):
        MicrobatchScheduler(1, 0, colocated=True)
    with pytest.raises(ValueError, match="max_tokens"):
        make_seq("r", 0)
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("r", [], 3)


def test_microbatch_steps_are_never_reused_across_refills():
    """Fault tolerance acks replicas by (microbatch, step): one pair, one step."""
    sched = MicrobatchScheduler(num_microbatches=2, batch_size=2, colocated=True)
    for i in range(7):
        sched.add(make_seq(f"r{i}", 1 + i % 3))
    seen = []
    for _ in range(30):
        for mb in range(2):
            batch = sched.schedule(mb)
            if batch.is_empty:
                continue
            seen.append((mb, batch.step))
            sched.postprocess(mb, {s.seq_id: 5 for s in batch.decode + batch.prefill})
    assert not sched.waiting and not any(sched.running)  # every sequence finished
    assert len(seen) == len(set(seen)) and len(seen) > 7


@pytest.mark.parametrize("colocated", [True, False])
def test_rewind_cuts_tokens_and_restarts_later_joiners(colocated):
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=colocated)
    old, new = make_seq("old", 10), make_seq("new", 10)
    if not colocated:
        old.append(0)  # the first token came with the prompt KV
    sched.add(old)
    for step in range(4):  # steps 0..3; "new" joins at step 2
        if step == 2:
            if not colocated:
                new.append(0)
            sched.add(new)
        batch = sched.schedule(0)
        sched.postprocess(0, {s.seq_id: 10 + step for s in batch.decode + batch.prefill})
    lengths, restarted = sched.rewind(0, 2)  # redo from step 2: "new" joined there
    # "old" took steps 0 and 1: colocated a prefill (3 positions, 1 token) and a decode.
    first = [] if colocated else [0]
    assert old.output_ids == first + [10, 11]
    assert lengths == {old.seq_id: 3 + len(old.output_ids) - 1}
    assert restarted == [new] and new.output_ids == [] and new.status is Status.WAITING
    assert sched.running[0] == [old] and sched.steps[0] == 2
