"""The microbatch scheduler alone: slots, early-stop refill, release, cancel, chunked prefill."""

from __future__ import annotations

import pytest

from orchestrator.kv.prefix_cache import PrefixCache
from orchestrator.layout import KVLayout
from orchestrator.pipeline.prefix import PipelinePrefix
from orchestrator.pipeline.scheduler import Batch, MicrobatchScheduler
from orchestrator.pipeline.sequence import FinishReason, Sequence, Status


def make_seq(name: str, max_tokens: int, eos_id: int | None = None,
             prompt_len: int = 3) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), max_tokens, eos_id)


def prompts(batch: Batch) -> list[Sequence]:
    return [c.seq for c in batch.prefill]


def run_step(sched: MicrobatchScheduler, mb: int = 0, token: int = 5) -> Batch:
    """Schedule one step and answer it as the last stage would: a token for every token
    step and every chunk that ends its prompt."""
    batch = sched.schedule(mb)
    sampled = batch.decode + [c.seq for c in batch.prefill if c.completes]
    sched.postprocess(mb, {s.seq_id: token for s in sampled})
    return batch


def test_fills_microbatches_up_to_batch_size():
    sched = MicrobatchScheduler(num_microbatches=2, batch_size=2, colocated=True)
    seqs = [make_seq(f"r{i}", 5) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first, second = sched.schedule(0), sched.schedule(1)
    assert prompts(first) == seqs[:2] and first.decode == []
    assert prompts(second) == seqs[2:4]
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
    assert batch.decode == [long] and prompts(batch) == [queued]


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
            sched.postprocess(mb, {s.seq_id: 5 for s in batch.decode + prompts(batch)})
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
        sched.postprocess(0, {s.seq_id: 10 + step for s in batch.decode + prompts(batch)})
    lengths, restarted = sched.rewind(0, 2)  # redo from step 2: "new" joined there
    # "old" took steps 0 and 1: colocated a prefill (3 positions, 1 token) and a decode.
    first = [] if colocated else [0]
    assert old.output_ids == first + [10, 11]
    assert lengths == {old.seq_id: 3 + len(old.output_ids) - 1}
    assert restarted == [new] and new.output_ids == [] and new.status is Status.WAITING
    assert sched.running[0] == [old] and sched.steps[0] == 2


def test_chunked_steps_stay_within_the_budget_and_never_hold_back_a_token_step():
    """Sarathi's stall-free batching: token steps first, then prompt chunks up to the
    budget; a started prompt goes on before a new one joins."""
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=4, colocated=True,
                                prefill_chunk=8)
    long, short, late = (make_seq("long", 20, prompt_len=19), make_seq("short", 20, prompt_len=3),
                         make_seq("late", 20, prompt_len=6))
    sched.add(long)
    sched.add(short)
    steps = []
    for step in range(8):
        if step == 1:
            sched.add(late)
        ready = [s for s in sched.running[0] if not s.is_prefilling]
        batch = run_step(sched)
        assert len(batch.decode) + sum(len(c.ids) for c in batch.prefill) <= 8
        assert batch.decode == ready  # every prompt done takes its token step, every step
        steps.append([(c.seq.request_id, c.start, c.end) for c in batch.prefill])
    # short waits for a slot's worth of budget; late joins with what is left of step 2
    assert steps[:4] == [[("long", 0, 8)], [("long", 8, 16)],
                         [("long", 16, 19), ("short", 0, 3), ("late", 0, 2)], [("late", 2, 6)]]
    # tokens: long and short sampled at step 2, late at step 3; one per step after
    assert len(long.output_ids) == len(short.output_ids) == 6 and len(late.output_ids) == 5


def test_a_first_chunk_starts_after_the_cached_blocks_and_pays_only_for_the_rest():
    """The index holds two blocks (8 positions) of ``hit``'s prompt: its first chunk runs
    8:12 and names them for the stages to load; the budget of 4 lets nothing else in. Its
    last chunk names its new third block for the stages to keep, findable only once that
    step came back; a rewind before its first chunk asks the index again."""
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True,
                                prefill_chunk=4)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=64)
    prefix = sched.prefix = PipelinePrefix(PrefixCache(layout, 4, 8, keep_kv=False))
    hit, other = make_seq("hit", 3, prompt_len=14), Sequence("other", list(range(100, 105)), 3)
    prefix.store(0, hit.prompt_ids[:8], "")
    prefix.answered(0)
    cached = prefix.hit(hit.prompt_ids, "")
    sched.add(hit)
    sched.add(other)
    first = run_step(sched)
    assert [(c.seq, c.start, c.end, c.load, c.store, c.ids) for c in first.prefill] == [
        (hit, 8, 12, cached, [], hit.prompt_ids[8:12])]
    assert len(cached) == 2 and hit.cached_tokens == 8
    second = sched.schedule(0)
    assert [(c.seq, c.start, c.end, c.load, c.ids) for c in second.prefill] == [
        (hit, 12, 14, [], hit.prompt_ids[12:]), (other, 0, 2, [], other.prompt_ids[:2])]
    assert [block for block, _ in second.prefill[0].store] == [2]  # its new block only
    assert prefix.hit(hit.prompt_ids, "") == cached  # not before the step came back
    sched.postprocess(0, {hit.seq_id: 5})
    assert len(prefix.hit(hit.prompt_ids, "")) == 3 and hit.output_ids == [5]
    sched.rewind(0, first.step)
    assert hit.prefilled == 0 and hit.output_ids == []
    sched.add(hit)
    assert run_step(sched).prefill[0].start == 12 and hit.cached_tokens == 12


def test_decode_is_never_starved_when_token_steps_fill_the_budget():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=4, colocated=True,
                                prefill_chunk=4)
    running = [make_seq(f"r{i}", 9, prompt_len=1) for i in range(3)]
    for s in running:
        sched.add(s)
    run_step(sched)  # three one-token prompts in one step
    sched.add(make_seq("waits", 5, prompt_len=10))
    batch = run_step(sched)
    assert batch.decode == running and [(c.start, c.end) for c in batch.prefill] == [(0, 1)]
    assert all(len(s.output_ids) == 2 for s in running)


def test_whole_prompts_without_a_budget():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True)
    seq = make_seq("r", 4, prompt_len=50)
    sched.add(seq)
    batch = run_step(sched)
    assert [(c.start, c.end, c.completes) for c in batch.prefill] == [(0, 50, True)]
    assert seq.output_ids == [5]


def test_a_budget_below_the_batch_or_without_colocation_is_refused():
    with pytest.raises(ValueError, match="at least the batch size 4"):
        MicrobatchScheduler(1, 4, colocated=True, prefill_chunk=3)
    with pytest.raises(ValueError, match="colocated"):
        MicrobatchScheduler(1, 4, colocated=False, prefill_chunk=64)


def test_rewind_mid_prompt_resumes_after_its_last_chunk_kept():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True,
                                prefill_chunk=4)
    done, mid = make_seq("done", 10, prompt_len=2), make_seq("mid", 10, prompt_len=11)
    sched.add(done)
    sched.add(mid)
    for _ in range(3):  # step 0: done 0:2 + mid 0:2; step 1: mid 2:5; step 2: mid 5:8
        run_step(sched)
    assert mid.prefilled == 8 and len(done.output_ids) == 3
    lengths, restarted = sched.rewind(0, 2)  # step 2 is redone
    assert restarted == [] and mid.prefilled == 5 and mid.output_ids == []
    assert lengths == {done.seq_id: 2 + 2 - 1, mid.seq_id: 5}
    assert len(done.output_ids) == 2
    batch = run_step(sched)
    assert [(c.seq, c.start, c.end) for c in batch.prefill] == [(mid, 5, 8)]
    # a redo from the step of the first chunk starts the prompt over
    lengths, restarted = sched.rewind(0, 0)
    assert restarted == [done, mid] and mid.prefilled == 0 and lengths == {}


def test_a_prompt_cancelled_between_chunks_is_freed_at_its_next_step():
    sched = MicrobatchScheduler(num_microbatches=1, batch_size=2, colocated=True,
                                prefill_chunk=4)
    seq = make_seq("r", 5, prompt_len=10)
    sched.add(seq)
    run_step(sched)
    assert sched.cancel("r") is seq
    batch = sched.schedule(0)
    assert batch.release == [seq.seq_id] and not batch.prefill and not sched.running[0]
