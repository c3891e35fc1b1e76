"""The head alone, its stages played by the test over in-process links: a step that fails
while the head waits for a repair is redone after it, not taken as answered; a request
whose prompt KV landed during a step joins the next."""

from __future__ import annotations

import threading

import pytest

from orchestrator.pipeline.head import NotKept, PipelineHead
from orchestrator.pipeline.link import KVProbe, QueueLink, StepMessage, TokenMessage
from orchestrator.pipeline.sequence import Sequence


def next_step(link: QueueLink) -> StepMessage:
    while not isinstance(message := link.recv(5.0), StepMessage):
        assert message is not None, "the head sent no step"
    return message


def test_a_step_failed_during_a_repair_is_redone():
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=1,
                        max_seq_len=64, recover_timeout_s=30.0).start()
    try:
        seq = head.submit_prefilled(Sequence("r", [1, 2, 3], 8, None), first_token=7)
        step0 = next_step(to_first)
        from_last.send(TokenMessage(0, step0.step, {seq.seq_id: 8}), 1.0)
        step1 = next_step(to_first)
        head.report_failure("stage 1 lost")  # the head pauses; the requests stay
        assert head.fault == "stage 1 lost" and not seq.is_finished
        from_last.send(TokenMessage(0, step1.step, {}, error="stage 2: no KV"), 1.0)
        # A drain marker, passed on behind that answer: once it is back, the head has it.
        drain = threading.Thread(target=head.drain, args=(to_first, 5.0))
        drain.start()
        from_last.send(to_first.recv(5.0), 1.0)
        drain.join()
        # Step 1 has no answer: redone from there (prompt 3 + first token + step 0's token).
        assert head.rewind({0: 100}) == {seq.seq_id: 4}
        head.resume()
        assert next_step(to_first).step == step1.step
        assert seq.output_ids == [7, 8] and seq.error is None
    finally:
        head.stop(1.0)


def test_a_prompt_whose_kv_landed_during_a_step_joins_the_next_step():
    """The KV probe rides on the running steps and is answered with their tokens, so a
    prefilled request is admitted before its microbatch's next step goes out (a probe
    answered after that step was issued made every request wait out one more step)."""
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=2,
                        max_seq_len=64).start()
    try:
        running = head.submit_prefilled(Sequence("a", [1, 2, 3], 8, None), first_token=7)
        step0 = next_step(to_first)
        assert step0.probe is None  # nothing waits for its KV
        waiting = head.submit_prefilled(Sequence("b", [4, 5], 8, None))
        # Step 0 answered: step 1 goes out carrying the probe for "b".
        from_last.send(TokenMessage(0, step0.step, {running.seq_id: 8}), 1.0)
        step1 = next_step(to_first)
        assert step1.probe is not None and step1.probe.requests == {waiting.seq_id: "b"}
        # The stages found its KV complete by the end of step 1's layers.
        answer = KVProbe({}, ready={waiting.seq_id: 9})
        from_last.send(TokenMessage(0, step1.step, {running.seq_id: 10}, probe=answer), 1.0)
        step2 = next_step(to_first)
        assert step2.admit == [waiting.seq_id]
        assert sorted(step2.seq_ids) == sorted([running.seq_id, waiting.seq_id])
        assert waiting.output_ids == [9] and step2.probe is None
    finally:
        head.stop(1.0)


def test_an_idle_head_issues_a_new_request_at_once():
    """A submission wakes the head's wait for answers: it does not wait out its poll."""
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=1,
                        max_seq_len=64, poll_s=30.0).start()
    try:
        assert to_first.recv(0.2) is None  # idle: the head waits on from_last for 30 s
        head.submit_prefilled(Sequence("r", [1, 2, 3], 8, None), first_token=7)
        assert isinstance(to_first.recv(5.0), StepMessage)  # well inside its 30 s poll
    finally:
        head.stop(1.0)


def test_a_head_whose_repair_failed_gives_up_at_once():
    """A failed repair ends the waiting requests now (the frontend runs them again
    elsewhere), not at the head's recover timeout."""
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=1,
                        max_seq_len=64, recover_timeout_s=300.0).start()
    try:
        seq = head.submit_prefilled(Sequence("r", [1, 2, 3], 8, None), first_token=7)
        next_step(to_first)
        head.report_failure("stage 1 lost")
        assert head.fault == "stage 1 lost" and not seq.is_finished
        head.give_up("recovery of stages [1] failed")
        assert seq.is_finished and seq.error == "recovery of stages [1] failed"
        assert head.broken == "recovery of stages [1] failed"
    finally:
        head.stop(1.0)


def test_a_lost_heads_request_is_reattached_on_the_kv_kept():
    """A new head told what the stages kept takes a request back with the tokens its client
    has: it joins with the KV cut to what both hold (one token delivered short of it: cut one
    more), the next input is the last token kept, and a later rewind counts from there."""
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=2,
                        max_seq_len=64, recover_timeout_s=30.0).start()
    try:
        # Prompt of 3, the stages hold 3 + 4 positions: 5 tokens made, the client has 4.
        head.expect_reattach({"r": (40, 7), "gone": (41, 5)})
        seq = head.reattach(Sequence("r", [1, 2, 3], 8, None), [7, 8, 9, 10])
        assert (seq.seq_id, seq.output_ids) == (40, [7, 8, 9, 10])
        step = next_step(to_first)
        assert step.admit == [40] and step.resume == {40: 6}  # 3 + 4 - 1: 10 is the input
        assert step.inputs.tolist() == [10]
        from_last.send(TokenMessage(0, step.step, {40: 11}), 1.0)
        step = next_step(to_first)
        assert step.resume == {} and seq.output_ids == [7, 8, 9, 10, 11]
        # Nothing kept of it, or already taken: it runs again from its prompt.
        with pytest.raises(NotKept):
            head.reattach(Sequence("r", [1, 2, 3], 8, None), [7])
        with pytest.raises(NotKept):
            head.reattach(Sequence("other", [1, 2, 3], 8, None), [7])
        # A new sequence of this head never takes a kept one's id (the stages' KV key).
        assert Sequence("new", [1], 1).seq_id > 41
        head.report_failure("stage 1 lost")
        from_last.send(TokenMessage(0, step.step, {}, error="stage 1 lost"), 1.0)
        # Redone from the step it joined at: the KV length and tokens it joined with.
        assert head.rewind({0: step.step - 1}) == {40: 6}
        assert seq.output_ids == [7, 8, 9, 10]
    finally:
        head.stop(1.0)


def test_kept_kv_no_frontend_reattaches_is_freed():
    to_first, from_last = QueueLink("to-first", 4), QueueLink("from-last", 4)
    head = PipelineHead(to_first, from_last, num_microbatches=1, batch_size=1,
                        max_seq_len=64, kv_timeout_s=0.05).start()
    try:
        head.expect_reattach({"r": (50, 6)})
        assert next_step(to_first).release == [50]
        with pytest.raises(NotKept):
            head.reattach(Sequence("r", [1, 2, 3], 8, None), [7, 8, 9])
    finally:
        head.stop(1.0)
