"""``stream_interval``: a streamed request gets its first token alone, then N tokens per
response, and the rest with its last; every token once, in order. The T-node is faked
out (``_generate_once`` relays what a feed would bring); what is tested is the relay."""

from __future__ import annotations

import pytest

from orchestrator.serving.frontend import Frontend
from orchestrator.serving.params import GenerationParams


def responses(interval: int, steps: list[list[int]], stream: bool = True) -> list[list[int]]:
    frontend = Frontend(["p:1"], [["h:1"]], b"secret", timeout_s=5.0,
                        stream_interval=interval)

    def once(prompt_ids, params, relay, is_cancelled, usage, attempt) -> None:
        for i, tokens in enumerate(steps):
            relay(tokens, None, i == len(steps) - 1)

    frontend._generate_once = once
    sent: list[list[int]] = []
    try:
        frontend.generate([1, 2], GenerationParams(max_tokens=32, stream=stream),
                          lambda tokens, *_: sent.append(tokens), lambda: False)
    finally:
        frontend.close()
    return sent


def test_one_token_per_response_by_default():
    assert responses(1, [[1], [2], [3, 4], [5]]) == [[1], [2], [3, 4], [5]]


@pytest.mark.parametrize(("interval", "expected"), [
    (2, [[1], [2, 3], [4, 5], [6, 7]]),
    (3, [[1], [2, 3, 4], [5, 6, 7]]),
    (4, [[1], [2, 3, 4, 5], [6, 7]]),
    (16, [[1], [2, 3, 4, 5, 6, 7]]),
])
def test_the_first_token_goes_alone_then_n_per_response_and_the_rest_last(interval, expected):
    assert responses(interval, [[1], [2], [3], [4], [5], [6], [7]]) == expected


def test_a_step_that_brings_more_than_n_sends_them_all_at_once():
    assert responses(2, [[1], [2, 3, 4], [5]]) == [[1], [2, 3, 4], [5]]


def test_without_streaming_everything_goes_in_the_last_response():
    assert responses(2, [[1], [2], [3]], stream=False) == [[1, 2, 3]]
