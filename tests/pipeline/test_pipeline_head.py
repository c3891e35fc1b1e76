"""The head alone, its stages played by the test over in-process links: a step that fails
while the head waits for a repair is redone after it, not taken as answered."""

from __future__ import annotations

import threading

from orchestrator.pipeline.head import PipelineHead
from orchestrator.pipeline.link import QueueLink, StepMessage, TokenMessage
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
