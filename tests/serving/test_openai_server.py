"""The OpenAI-compatible API's own logic, without Triton: stop strings, refusals, errors."""

import pytest

from orchestrator.serving.openai_server import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    OpenAIServer,
)


@pytest.fixture(scope="module")
def server(tiny_model):
    return OpenAIServer("127.0.0.1:1", tiny_model("llama"), model_name="tiny")


def test_a_stop_string_ends_the_text_before_it_even_across_chunks():
    choice = Choice(stops=["END"])
    sent = choice.add("hello E", 2) + choice.add("NDtail", 2)
    assert sent == "hello " and choice.text == "hello " and choice.finish_reason == "stop"
    plain = Choice(stops=[])
    assert plain.add("abc", 3) == "abc" and plain.finish(max_tokens=3) == ""
    assert plain.finish_reason == "length"
    held = Choice(stops=["xyz"])
    assert held.add("abcx", 2) == "ab" and held.finish(max_tokens=8) == "cx"
    assert held.finish_reason == "stop"


def test_requests_map_to_checked_parameters(server):
    call = server.call(CompletionRequest(model="tiny", prompt=["a", "b"], max_tokens=5, n=2,
                                         seed=3, temperature=0.5, stop="x"), ["a", "b"], 5)
    assert call.params.num_return_sequences == 2 and call.params.seed == 3
    assert call.choice(1, 1)[0] == 3  # prompt 1, sample 1
    with pytest.raises(ApiError, match="model 'gpt' does not exist") as info:
        server.call(CompletionRequest(model="gpt", prompt="a"), ["a"], 5)
    assert info.value.status == 404
    for body, message in [
        (CompletionRequest(model="tiny", prompt="a", temperature=-1), "temperature must be"),
        (CompletionRequest(model="tiny", prompt="a", logprobs=2), "logprobs are not supported"),
        (CompletionRequest(model="tiny", prompt="a", best_of=3), "best_of is not supported"),
        (CompletionRequest(model="tiny", prompt="a", top_p=float("nan")), "top_p must be a fin"),
    ]:
        with pytest.raises(ApiError, match=message) as info:
            server.call(body, ["a"], 5)
        assert info.value.status == 400


def test_chat_uses_the_tokenizer_template_and_refuses_without_one(server, tiny_model, tmp_path):
    body = ChatRequest(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert server.chat_prompt(body) == "user: Hi\nassistant:"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tiny_model("llama") / "tokenizer.json").read_bytes())
    with pytest.raises(ApiError, match="has no chat template"):
        OpenAIServer("127.0.0.1:1", bare, "bare").chat_prompt(body)
