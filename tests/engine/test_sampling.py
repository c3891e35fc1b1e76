"""The sampler's logits processors, each shown by its effect, and position-seeded draws."""

import pytest
import torch

from orchestrator.engine.sampling import Sampler, SamplingParams
from orchestrator.pipeline.sequence import FinishReason, Sequence


def logits(*values: float) -> torch.Tensor:
    return torch.tensor([values])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, prompt=(0, 1), made=(3,)))
    out = sampler.process(logits(4.0, -1.0, 5.0, 2.0))
    assert out.tolist() == [[2.0, -2.0, 5.0, 1.0]]  # 0, 1 from the prompt, 3 made


def test_presence_and_frequency_penalties_count_output_tokens():
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                     made=(2, 2, 1)))
    out = sampler.process(logits(1.0, 1.0, 1.0))
    assert out.tolist() == [[1.0, 0.25, 0.0]]  # 1: 0.5 + 0.25; 2: 0.5 + 2 x 0.25


def test_min_tokens_holds_off_end_id_then_lets_it_through():
    sampler = Sampler(SamplingParams(min_tokens=2, end_id=0))
    assert [int(sampler(logits(9.0, 1.0, 0.0))) for _ in range(3)] == [1, 1, 0]


def test_bad_words_are_never_completed():
    sampler = Sampler(SamplingParams(bad_words=((2,), (1, 0))))
    picks = [int(sampler(logits(5.0, 6.0, 9.0))) for _ in range(2)]
    assert picks == [1, 1]  # 2 is banned; after 1, 0 would complete (1, 0)


def test_seeded_draws_depend_on_seed_and_position_only():
    params = SamplingParams(temperature=1.0, seed=11)
    row = torch.randn(1, 50)
    whole = Sampler(params)
    run = [int(whole(row)) for _ in range(6)]
    # A P-node draws the first, a T-node resumes after it: the same tokens.
    first = int(Sampler(params)(row))
    rest = Sampler(params.resumed([first]))
    assert [first] + [int(rest(row)) for _ in range(5)] == run
    other = Sampler(SamplingParams(temperature=1.0, seed=12))
    assert [int(other(row)) for _ in range(6)] != run


def test_params_survive_a_json_round_trip():
    import json
    from dataclasses import asdict

    params = SamplingParams(bad_words=((1, 2),), prompt=(3,), made=(4,))
    assert SamplingParams(**json.loads(json.dumps(asdict(params)))) == params
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)


def test_stop_word_ends_a_sequence_after_it():
    seq = Sequence("r", [1], max_tokens=8, stop_words=((5, 6),))
    for token in (5, 7, 5, 6):
        seq.append(token)
    assert seq.finish_reason is FinishReason.STOP and seq.output_ids == [5, 7, 5, 6]


def test_log_probs_are_the_raw_distribution_whatever_the_processing():
    """Log-probs are the log-softmax of the model's logits, before penalties and masks:
    the picked token's, and the top alternatives', most likely first."""
    row = logits(1.0, 3.0, 2.0, 0.5)
    want = torch.log_softmax(row[0], -1)
    token, log_prob = Sampler(SamplingParams(log_probs=True, top_log_probs=2)).pick(row)
    assert token == 1 and log_prob.log_prob == pytest.approx(float(want[1]), abs=1e-6)
    assert [i for i, _ in log_prob.top] == [1, 2]
    assert [p for _, p in log_prob.top] == pytest.approx([float(want[1]), float(want[2])])
    # A bad word moves the pick; its log-prob is still the raw model's.
    banned = Sampler(SamplingParams(bad_words=((1,),), log_probs=True))
    token, log_prob = banned.pick(row)
    assert token == 2 and log_prob.log_prob == pytest.approx(float(want[2]), abs=1e-6)
    assert log_prob.top == ()


def test_log_probs_cost_nothing_unless_asked():
    token, log_prob = Sampler().pick(logits(1.0, 3.0))
    assert (token, log_prob) == (1, None)


def test_log_probs_travel_with_the_tokens_and_are_cut_on_a_rewind():
    from orchestrator.engine.log_probs import TokenLogProb, decode, encode

    seq = Sequence("r", [1, 2], max_tokens=5, sampling=SamplingParams(log_probs=True))
    seq.append(7)  # the P-node's first token: its log-prob went to the client from there
    seq.append(8, TokenLogProb(-0.5, ((8, -0.5),)))
    seq.append(9, TokenLogProb(-1.25))
    assert seq.log_probs[0] is None and decode(encode(seq.log_probs[1:])) == seq.log_probs[1:]
    seq.truncate(2)
    assert seq.output_ids == [7, 8] and len(seq.log_probs) == 2
    plain = Sequence("p", [1], max_tokens=3)
    plain.append(4)
    assert plain.log_probs == []
