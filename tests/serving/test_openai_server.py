"""The OpenAI-compatible API's own logic, without Triton: stop strings, refusals, errors."""

import json

import numpy as np
import pytest

from orchestrator.serving.openai_server import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    OpenAIServer,
    TokenInfo,
)


@pytest.fixture(scope="module")
def server(tiny_model):
    return OpenAIServer("127.0.0.1:1", tiny_model("llama"), model_name="tiny")


def test_a_stop_string_ends_the_text_before_it_even_across_chunks():
    choice = Choice(stops=["END"])
    sent = choice.add("hello E", [5, 6]) + choice.add("NDtail", [7, 8])
    assert sent == "hello " and choice.text == "hello " and choice.finish_reason == "stop"
    held = Choice(stops=["xyz"])
    assert held.add("abcx", [5, 6]) == "ab" and held.finish(max_tokens=8, end_id=2) == "cx"
    assert held.finish_reason == "stop"


def test_log_probs_of_tokens_a_stop_string_cut_off_never_go_out(server):
    choice = Choice(stops=["END"])
    choice.add("ab", [5], [TokenInfo(5, -0.5, [], 0)])
    choice.add("cE", [6], [TokenInfo(6, -1.0, [], 0)])
    assert [i.id for i in choice.new_log_probs()] == [5]  # "cE" may start the stop string
    choice.add("NDx", [7], [TokenInfo(7, -2.0, [], 0)])
    choice.finish(max_tokens=8, end_id=2)
    assert [(i.id, i.offset) for i in choice.new_log_probs()] == [(6, 2)]
    ended = Choice(stops=[])
    ended.add("ab", [5], [TokenInfo(5, -0.5, [], 0)])
    ended.add("", [2], [TokenInfo(2, -0.1, [], 0)])  # eos: no text, still a token
    ended.finish(max_tokens=2, end_id=2)
    assert [i.id for i in ended.new_log_probs()] == [5, 2]


def test_log_probs_map_to_the_ensemble_inputs(server):
    completion = server.call(CompletionRequest(model="tiny", prompt="a", logprobs=0), ["a"], 4)
    assert (completion.params.return_log_probs, completion.params.top_log_probs) == (True, 0)
    chat = server.call(ChatRequest(model="tiny", messages=[], logprobs=True, top_logprobs=3),
                       ["a"], 4)
    assert (chat.params.return_log_probs, chat.params.top_log_probs) == (True, 3)
    plain = server.call(ChatRequest(model="tiny", messages=[]), ["a"], 4)
    assert not plain.params.return_log_probs


def test_ignore_eos_runs_to_max_tokens(server):
    """OpenAI's choices end at the model's eos; vLLM's ``ignore_eos`` (benchmarks send it)
    sends end_id -1, none (absent, tensorrt_llm_bls would fill in the tokenizer's)."""

    def end_id(call) -> list[int]:  # the end_id input the call fills
        tensor = next(t for t in server._inputs(call) if t.name() == "end_id")
        return np.frombuffer(tensor._raw_content, np.int32).tolist()

    assert server.eos_id == 2  # the dummy checkpoints' </s>
    plain = server.call(CompletionRequest(model="tiny", prompt="a"), ["a"], 4)
    assert plain.params.end_id == server.eos_id and end_id(plain) == [2]
    ignored = server.call(ChatRequest(model="tiny", messages=[], ignore_eos=True), ["a"], 4)
    assert ignored.params.end_id is None and end_id(ignored) == [-1]
    choice = Choice(stops=[])
    choice.add("abc", [5, 2, 7])  # the eos id as any other token
    choice.finish(max_tokens=3, end_id=ignored.params.end_id)
    assert choice.finish_reason == "length"


@pytest.mark.parametrize(("ids", "reason"), [
    ([5, 6, 7], "length"),  # max_tokens ran out
    ([5, 6, 2], "stop"),  # end_id as the last allowed token: it stopped, it was not cut
    ([5, 2], "stop"),  # end_id before max_tokens
    ([5, 6], "stop"),  # ended early without end_id (a stop word's tokens)
])
def test_finish_reason_is_length_only_when_max_tokens_cut_the_text(ids, reason):
    choice = Choice(stops=[])
    assert choice.add("abc", ids) == "abc" and choice.finish(max_tokens=3, end_id=2) == ""
    assert choice.finish_reason == reason


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
        (CompletionRequest(model="tiny", prompt="a", logprobs=6),
         "logprobs 6 is not supported: at most 5"),
        (CompletionRequest(model="tiny", prompt="a", top_logprobs=2), "top_logprobs is for chat"),
        (ChatRequest(model="tiny", messages=[], top_logprobs=2),
         "top_logprobs 2 needs logprobs true"),
        (ChatRequest(model="tiny", messages=[], logprobs=True, top_logprobs=7),
         "top_logprobs 7 is not supported"),
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


def test_503_in_openai_shape_when_triton_is_unreachable(tiny_model):
    """The openai SDK against the real API over HTTP, with nothing at its Triton address."""
    import threading

    import openai
    import uvicorn

    from orchestrator.cluster.launcher import free_port
    from orchestrator.serving.openai_server import create_app

    dead = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"  # two frontends, both gone
    app = create_app(OpenAIServer(dead, tiny_model("llama"), model_name="tiny"))
    api = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    thread = threading.Thread(target=api.run, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api.config.port}/v1",
                               api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                          stream=stream)
            assert info.value.status_code == 503
            assert info.value.body["type"] == "service_unavailable"
    finally:
        api.should_exit = True
        thread.join(timeout=10)


def test_node_failures_are_503_and_refusals_400():
    """The frontend leads a failure no node could get past with UNAVAILABLE (a decoupled
    model's error reaches a gRPC client as text only); the API answers it 503."""
    from tritonclient.utils import InferenceServerException

    from orchestrator.serving.batch import failure_message
    from orchestrator.serving.frontend import PipelineLost, ServingError
    from orchestrator.serving.openai_server import _api_error
    from orchestrator.serving.router import NoNodeError

    try:
        raise ServingError("still failing 60 s after the first failure") from PipelineLost("x")
    except ServingError as exc:
        lost = exc
    for error, status in [(NoNodeError("all nodes down: a"), 503), (lost, 503),
                          (ServingError("decode node a: prompt too long"), 400)]:
        message = failure_message(error)
        assert _api_error(InferenceServerException(message)).status == status, message


def test_504_not_400_when_triton_does_not_answer_in_time(tiny_model, monkeypatch):
    """A gRPC server that takes the stream and never answers: the API's own deadline is a
    server-side timeout (504), not a bad request (400)."""
    import asyncio

    import grpc

    import orchestrator.serving.openai_server as api

    monkeypatch.setattr(api, "TIMEOUT_S", 1.0)

    class Silent(grpc.GenericRpcHandler):
        def service(self, _details):
            async def never(_requests, _context):
                await asyncio.sleep(30)
                yield b""

            return grpc.stream_stream_rpc_method_handler(never)

    async def ask() -> ApiError:
        silent = grpc.aio.server()
        silent.add_generic_rpc_handlers((Silent(),))
        port = silent.add_insecure_port("127.0.0.1:0")
        await silent.start()
        late = OpenAIServer(f"127.0.0.1:{port}", tiny_model("llama"), model_name="tiny")
        try:
            async for _ in late.run(late.call(CompletionRequest(model="tiny", prompt="a"),
                                              ["a"], 4)):
                pass
        except ApiError as exc:
            return exc
        finally:
            await silent.stop(0)
        raise AssertionError("the call ended without an error")

    error = asyncio.run(ask())
    assert (error.status, error.kind) == (504, "timeout")


@pytest.fixture(scope="module")
def api(tiny_model):
    """The app in-process (Starlette's test client), with a 10 kB body limit and a 4 kB
    prompt limit; nothing here reaches Triton."""
    from fastapi.testclient import TestClient

    from orchestrator.serving.openai_server import create_app

    limited = OpenAIServer("127.0.0.1:1", tiny_model("llama"), "tiny", max_prompt_bytes=4_000)
    with TestClient(create_app(limited, max_body_bytes=10_000)) as client:
        yield client


def _post(api, route: str, body: dict):
    """JSON as the openai SDK sends it (ASCII: a lone surrogate as its escape)."""
    return api.post(route, content=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})


def _openai_error(response, status: int, text: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and text in error["message"]
    return error


@pytest.mark.parametrize(("body", "status", "text", "param"), [
    ({"prompt": "w" * 20_000}, 413, "exceeds the limit of 10000 bytes", None),
    ({"prompt": "w" * 5_000}, 400, "exceeds the prompt limit", "prompt"),  # over max_prompt_bytes
    ({"prompt": "Hi \ud800"}, 400, "not valid Unicode", "prompt"),
    ({"prompt": "Hi", "stop": ["\ud800"]}, 400, "not valid Unicode", "stop"),
    ({"prompt": "Hi", "stop": ["x"] * 65}, 400, "65 stop strings: at most 64", "stop"),
    ({"prompt": "Hi", "max_tokens": 4294967300}, 400, "less than or equal", "max_tokens"),
    ({"prompt": "Hi", "n": 10**12}, 400, "less than or equal", "n"),
    ({"prompt": "Hi", "seed": 2**70}, 400, "less than", "seed"),
    ({"prompt": "Hi", "logprobs": 10**12}, 400, "at most 5", "logprobs"),
    ({}, 400, "prompt", "prompt"),
])
def test_hostile_bodies_get_openai_errors_before_any_work(api, body, status, text, param):
    error = _openai_error(_post(api, "/v1/completions", {"model": "tiny", **body}), status,
                          text)
    assert error["param"] == param


def test_a_body_without_content_length_is_cut_off_at_the_limit(api):
    def chunks():  # sent chunked: no Content-Length to refuse it by
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"w" * 1_000
        yield b'"}'

    _openai_error(api.post("/v1/completions", content=chunks(),
                           headers={"Content-Type": "application/json"}), 413, "exceeds")


def test_fastapis_own_errors_take_openais_shape(api):
    _openai_error(api.get("/v1/completions"), 405, "Method Not Allowed")
    _openai_error(api.post("/v1/nowhere", json={}), 404, "Not Found")
    _openai_error(api.post("/v1/completions", content=b'{"model": ',
                           headers={"Content-Type": "application/json"}), 400, "JSON")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}
    assert _openai_error(_post(api, "/v1/chat/completions", chat), 400,
                         "not valid Unicode")["param"] == "messages"


def test_prompt_tokens_are_counted_off_the_event_loop(server):
    import asyncio

    call = asyncio.run(server.prepare(CompletionRequest(model="tiny", prompt=["a b", "c"]),
                                      ["a b", "c"], 4))
    assert call.prompt_tokens == sum(len(server.tokenizer.encode(p).ids) for p in ["a b", "c"])


def test_stop_strings_reach_the_ensemble_whole(server):
    """A stop string holding a comma, a quote or a newline is one stop word to the ensemble
    (the backend's form is comma-separated: sent bare, "a,b" stopped at "a")."""
    import numpy as np
    from tritonclient.utils import deserialize_bytes_tensor

    from orchestrator.serving.params import parse_words

    stops = ["a,b", 'say "hi"', "\n", "x\ny"]
    call = server.call(CompletionRequest(model="tiny", prompt="a", stop=stops), ["a"], 4)
    (sent,) = [t for t in server._inputs(call) if t.name() == "stop_words"]
    assert sent.shape() == [1, len(stops)]
    row = deserialize_bytes_tensor(np.frombuffer(sent._raw_content, np.uint8))  # as Triton's
    assert parse_words(list(row)) == stops
