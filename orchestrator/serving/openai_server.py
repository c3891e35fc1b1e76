"""An OpenAI-compatible HTTP API in front of ``tensorrt_llm_bls``: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (FastAPI on uvicorn).

Each call becomes one batched request to ``tensorrt_llm_bls`` (the ensemble's contract)
over Triton gRPC (asyncio ``tritonclient``): a row per prompt, ``num_return_sequences`` =
``n``; responses come back by (``batch_index``, ``sequence_index``), which give the
choice's index. There is no second inference path: parameters map to the contract's
inputs and are checked by :mod:`orchestrator.serving.params`. ``stop`` ends a choice where
its text first holds a stop string (the string is left out, as OpenAI does).
``logprobs`` / ``top_logprobs`` map to ``return_log_probs`` / ``top_log_probs``: each
token's log-prob under the raw model distribution, with up to 5 alternatives.

A client that disconnects, streaming or not, cancels its gRPC stream; unlike the
ensemble's, ``tensorrt_llm_bls``'s cancellation reaches the T-node, which frees the
request's slot. Errors use OpenAI's JSON shape, FastAPI's own included: 400 bad parameters
or JSON, 404 unknown model or route, 405 wrong method, 413 a body over ``max_body_bytes``
(refused by its Content-Length, or once that many bytes came, before it is parsed), 503
when no node can serve (Triton unreachable, every node of a pool down), 504 when the
answer took longer than ``TIMEOUT_S``.

Hostile input costs the other clients nothing: a prompt is refused by its size in bytes
(``max_prompt_bytes``: the context times the tokenizer's longest token, as the frontend's
limit) before it is tokenized, and tokenizing runs on a worker thread with the GIL
released (``encode_batch``), never on the event loop. Integers are range-checked before
any cast; text that is not valid Unicode (a lone surrogate) is a 400.

With several frontends (``--grpc-url A,B``: ``dejavu up --frontends N``) each request
goes to the next in turn, and a request whose frontend is unreachable before it answered
(killed, not started yet) goes to the next one: a client sees no error for it. A stream
that had answered ends with an error when its frontend is lost (its tokens are out).

    python -m orchestrator.serving.openai_server --grpc-url 127.0.0.1:8001 --model-dir M
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from orchestrator.control.client import is_unreachable
from orchestrator.engine.config import ModelConfig
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.limits import prompt_bytes_limit
from orchestrator.serving.params import (
    MAX_CACHE_SALT_BYTES,
    MAX_RETURN_SEQUENCES,
    MAX_TOP_LOG_PROBS,
    MAX_WORDS,
    MAX_WORDS_BYTES,
    GenerationParams,
    RequestError,
)
from orchestrator.serving.router import UNAVAILABLE
from orchestrator.serving.text import CONTEXT_TOKENS, new_text

log = logging.getLogger("dejavu.openai")
TIMEOUT_S = 120.0
DISCONNECT_POLL_S = 0.05  # how often a waiting call asks whether its client left
MAX_BODY_BYTES = 2 * 2**20  # a request body above this is refused before it is parsed
INT32_MAX = 2**31 - 1  # the ensemble's integer inputs are INT32


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status)


class BodyLimit:
    """Refuses (413) a request body over ``limit`` bytes before anything parses it: at once
    by its Content-Length, or as soon as that many bytes of a body sent without one came."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            response = self._too_large(length.decode("latin-1")).response()
            response.headers["Connection"] = "close"  # not a byte more of it is read
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> ASGIMessage:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # FastAPI passes its HTTPException on to the handler
                raise HTTPException(413, str(self._too_large(f"over {received}")),
                                    headers={"Connection": "close"})
            return message

        await self.app(scope, limited, send)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"request body of {size} bytes exceeds the limit of "
                             f"{self.limit} bytes")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are refused by _refuse_extra

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # checked before any cast
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_RETURN_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)  # the ensemble's is UINT64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None  # range-checked by _log_probs_asked
    top_logprobs: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (what benchmarks ask)
    cache_salt: str | None = None  # vLLM's: checked in bytes by OpenAIServer.call


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


@dataclass
class TokenInfo:
    """One generated token's log-prob, and the likeliest alternatives' (id, log-prob)."""

    id: int
    log_prob: float
    top: list[tuple[int, float]]
    offset: int  # where its text starts in the response's text, then in the choice's


@dataclass
class Choice:
    """One sequence's text so far; holds back what could still become a stop string."""

    stops: list[str]
    text: str = ""  # all text made
    sent: int = 0  # characters of ``text`` already sent
    tokens: int = 0
    last_token: int | None = None
    finish_reason: str | None = None
    log_probs: list[TokenInfo] = field(default_factory=list)  # if asked for
    log_probs_sent: int = 0
    cut: bool = False  # a stop string ended it
    ended: bool = False
    ids: list[int] = field(default_factory=list)  # every token made

    def add(self, text: str, ids: list[int], log_probs: list[TokenInfo] = ()) -> str:
        """New text (of the new token ``ids``) safe to send now; ``log_probs``' offsets are
        into ``text``."""
        for info in log_probs:
            info.offset += len(self.text)
        self.log_probs += log_probs
        self.text += text
        self.tokens += len(ids)
        self.ids += ids
        if ids:
            self.last_token = ids[-1]
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish_reason, self.cut = self.text[:cut], "stop", True
            safe = cut
        else:  # a stop string may be starting at the end: keep its length - 1 back
            safe = len(self.text) - max((len(s) - 1 for s in self.stops), default=0)
        new = self.text[self.sent: max(self.sent, safe)]
        self.sent += len(new)
        return new

    def finish(self, max_tokens: int, end_id: int | None) -> str:
        """The text held back, once the sequence has ended: ``stop`` if it ended at a stop
        string or ``end_id`` (even as its last allowed token), ``length`` if max_tokens ran
        out."""
        if self.finish_reason is None:
            ended = self.last_token is not None and self.last_token == end_id
            self.finish_reason = "length" if self.tokens >= max_tokens and not ended else "stop"
        self.ended = True
        new, self.sent = self.text[self.sent:], len(self.text)
        return new

    def new_log_probs(self) -> list[TokenInfo]:
        """Log-probs not sent before of the tokens whose text starts in what was sent; once
        the sequence has ended, of every token left unless a stop string cut it off."""
        every = self.ended and not self.cut
        end = self.log_probs_sent
        while end < len(self.log_probs) and (every or self.log_probs[end].offset < self.sent):
            end += 1
        new, self.log_probs_sent = self.log_probs[self.log_probs_sent:end], end
        return new


@dataclass
class Call:
    """One API call as an ensemble request."""

    prompts: list[str]
    params: GenerationParams
    stops: list[str]
    prompt_tokens: int = 0  # counted by OpenAIServer.prepare, off the event loop
    cache_salt: str = ""  # vLLM's field: cached prompt KV is shared only under one salt
    choices: dict[int, Choice] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt (batch index)

    def choice(self, batch_index: int, sequence_index: int) -> tuple[int, Choice]:
        index = batch_index * self.params.num_return_sequences + sequence_index
        return index, self.choices.setdefault(index, Choice(self.stops))

    def usage(self) -> dict:
        made = sum(c.tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": made,
                "total_tokens": self.prompt_tokens + made,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


class OpenAIServer:
    def __init__(self, grpc_url: str, model_dir: Path, model_name: str = "",
                 triton_model: str = "tensorrt_llm_bls", max_prompt_bytes: int | None = None
                 ) -> None:
        """``grpc_url``: the frontend's Triton gRPC address, or several, comma-separated
        (each request to the next in turn; to another if one is unreachable);
        ``max_prompt_bytes``: the longest prompt text (UTF-8 bytes); None: the frontend's
        default limit for the model's context (:func:`prompt_bytes_limit`; without a
        config.json: ``MAX_BODY_BYTES``)."""
        self.grpc_urls, self.triton_model = grpc_url.split(","), triton_model
        self._turn = itertools.count()
        self.model_name = model_name or Path(model_dir).name
        self.tokenizer = load_tokenizer(model_dir)
        model = (ModelConfig.from_dir(model_dir) if (Path(model_dir) / "config.json").exists()
                 else None)
        self.max_prompt_bytes = max_prompt_bytes or (
            MAX_BODY_BYTES if model is None
            else prompt_bytes_limit(model.max_positions, self.tokenizer))
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.chat_template = config.get("chat_template")
        # OpenAI's semantics: a choice ends at the model's eos (unless ignore_eos)
        self.eos_id = None if model is None else model.eos_id
        self.created = int(time.time())

    # -- requests -> calls ---------------------------------------------------------------

    def call(self, body: _Sampling, prompts: list[str], max_tokens: int | None) -> Call:
        if body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} does not exist: this server serves "
                                f"{self.model_name!r}", param="model")
        _refuse_unsupported(body)
        return_log_probs, top = _log_probs_asked(body)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_WORDS:
            raise ApiError(400, f"{len(stops)} stop strings: at most {MAX_WORDS}", param="stop")
        stop_bytes = sum(_utf8_size(s, "stop") for s in stops)
        if stop_bytes > MAX_WORDS_BYTES:
            raise ApiError(400, f"stop strings of {stop_bytes} bytes: at most "
                                f"{MAX_WORDS_BYTES}", param="stop")
        try:
            params = GenerationParams(
                return_log_probs=return_log_probs, top_log_probs=top,
                max_tokens=16 if max_tokens is None else max_tokens,
                end_id=None if body.ignore_eos else self.eos_id,
                temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, num_return_sequences=body.n,
                stream=body.stream, exclude_input_in_output=True)
            params.check()
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
        if not prompts or not all(prompts):
            raise ApiError(400, "prompt must be a non-empty string or list of them",
                           param="prompt")
        if not isinstance(body, ChatRequest):  # a chat's messages: checked by chat_prompt
            for prompt in prompts:  # by size, before anything reads the text
                self.check_prompt_bytes(_utf8_size(prompt, "prompt"), "prompt")
        salt = body.cache_salt or ""
        if _utf8_size(salt, "cache_salt") > MAX_CACHE_SALT_BYTES:
            raise ApiError(400, f"cache_salt over {MAX_CACHE_SALT_BYTES} bytes",
                           param="cache_salt")
        return Call(prompts, params, [s for s in stops if s], cache_salt=salt)

    async def prepare(self, body: _Sampling, prompts: list[str], max_tokens: int | None
                      ) -> Call:
        """:meth:`call`, with its prompt tokens counted on a worker thread (``encode_batch``
        releases the GIL: the event loop serves other clients meanwhile)."""
        call = self.call(body, prompts, max_tokens)
        encoded = await asyncio.to_thread(self.tokenizer.encode_batch, prompts)
        call.prompt_tokens = sum(len(e.ids) for e in encoded)
        return call

    def check_prompt_bytes(self, size: int, param: str) -> None:
        """The one prompt byte limit: a completion's prompt, or a chat's messages."""
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"{param} of {size} bytes exceeds the prompt limit of "
                                f"{self.max_prompt_bytes} bytes", param=param)

    def chat_prompt(self, body: ChatRequest) -> str:
        if not self.chat_template:
            raise ApiError(400, f"model {self.model_name!r} has no chat template "
                                "(tokenizer_config.json chat_template): use /v1/completions")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # before the template copies it around
        self.check_prompt_bytes(sum(_utf8_size(m.content, "messages")
                                    + _utf8_size(m.role, "messages") for m in body.messages),
                                "messages")
        template = ImmutableSandboxedEnvironment().from_string(self.chat_template)
        return template.render(messages=[m.model_dump() for m in body.messages],
                               add_generation_prompt=True)

    def log_probs(self, call: Call, choice: Choice, chat: bool) -> dict | None:
        """The OpenAI ``logprobs`` of the choice's tokens not sent before (None: not asked
        for, or none new): chat's ``content`` entries, or completions' parallel lists
        (``top_logprobs`` holds the alternatives and the sampled token, as OpenAI's)."""
        infos = choice.new_log_probs() if call.params.return_log_probs else []
        if not infos:
            return None
        text = self.token_text
        if chat:
            def entry(token: int, log_prob: float) -> dict:
                piece = text(token)
                return {"token": piece, "logprob": log_prob, "bytes": list(piece.encode())}

            return {"content": [entry(i.id, i.log_prob) | {
                "top_logprobs": [entry(*alt) for alt in i.top]} for i in infos],
                "refusal": None}
        return {"tokens": [text(i.id) for i in infos],
                "token_logprobs": [i.log_prob for i in infos],
                "top_logprobs": [{text(t): p for t, p in i.top} | {text(i.id): i.log_prob}
                                 for i in infos],
                "text_offset": [i.offset for i in infos]}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # -- the ensemble --------------------------------------------------------------------

    def _inputs(self, call: Call) -> list:
        import tritonclient.grpc.aio as grpcclient

        rows, p = len(call.prompts), call.params
        arrays = {
            "text_input": np.array([[s.encode()] for s in call.prompts], dtype=np.object_),
            "max_tokens": np.full((rows, 1), p.max_tokens, np.int32),
            "temperature": np.full((rows, 1), p.temperature, np.float32),
            "top_p": np.full((rows, 1), p.top_p, np.float32),
            "presence_penalty": np.full((rows, 1), p.presence_penalty, np.float32),
            "frequency_penalty": np.full((rows, 1), p.frequency_penalty, np.float32),
            "num_return_sequences": np.full((rows, 1), p.num_return_sequences, np.int32),
            "exclude_input_in_output": np.full((rows, 1), True),
            "stream": np.full((rows, 1), True),  # stops are found in the text as it comes
        }
        # -1: no end token (ignore_eos, or no eos known); absent, tensorrt_llm_bls would fill
        # in the tokenizer's, as the backend's preprocessing does
        arrays["end_id"] = np.full((rows, 1), -1 if p.end_id is None else p.end_id, np.int32)
        if p.seed is not None:
            arrays["seed"] = np.full((rows, 1), p.seed, np.uint64)
        if call.cache_salt:
            arrays["cache_salt"] = np.array([[call.cache_salt.encode()]] * rows, np.object_)
        if p.return_log_probs:
            arrays["return_log_probs"] = np.full((rows, 1), True)
            arrays["top_log_probs"] = np.full((rows, 1), p.top_log_probs, np.int32)
        if call.stops:  # each quoted: the backend's form splits at commas, drops newlines
            quoted = ['"{}"'.format(s.replace('"', '""')).encode() for s in call.stops]
            arrays["stop_words"] = np.array([quoted] * rows, dtype=np.object_)
        inputs = []
        for name, array in arrays.items():
            inputs.append(grpcclient.InferInput(name, list(array.shape),
                                                np_to_triton_dtype(array.dtype)))
            inputs[-1].set_data_from_numpy(array)
        return inputs

    async def run(self, call: Call) -> AsyncIterator[tuple[int, str]]:
        """(choice index, new text) as the ensemble makes it (the choice keeps the tokens'
        log-probs, if asked for); ends when every choice has ended, cancelling the request
        early if all choices met a stop string. A frontend unreachable before it answered
        hands the request to the next one."""
        first = next(self._turn)
        urls = [self.grpc_urls[(first + i) % len(self.grpc_urls)]
                for i in range(len(self.grpc_urls))]
        for url in urls:
            answered = False
            try:
                async for item in self._run_on(url, call):
                    answered = True
                    yield item
                return
            except _FrontendLost as lost:
                if answered or url == urls[-1]:
                    raise lost.error from None
                log.warning("frontend %s unreachable (%s); the request goes to the next",
                            url, lost.error)

    async def _run_on(self, url: str, call: Call) -> AsyncIterator[tuple[int, str]]:
        """:meth:`run` on the frontend at ``url``; _FrontendLost if it is unreachable."""
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(url)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.triton_model, "inputs": self._inputs(call),
                   "request_id": uuid.uuid4().hex, "enable_empty_final_response": True}
            await done.wait()  # keep the stream open until the last response

        stream = client.stream_infer(requests(), stream_timeout=TIMEOUT_S)
        try:
            async for result, error in stream:
                if error is not None:
                    raise _lost_or_api_error(error)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                text = result.as_numpy("text_output")
                if text is not None:
                    row = int(result.as_numpy("batch_index").reshape(-1)[0])
                    index, choice = call.choice(
                        row, int(result.as_numpy("sequence_index").reshape(-1)[0]))
                    cached = result.as_numpy("cached_tokens")
                    if cached is not None:  # a prompt's, whichever of its sequences says it
                        call.cached_tokens[row] = max(call.cached_tokens.get(row, 0),
                                                      int(cached.reshape(-1)[0]))
                    if choice.finish_reason is None:
                        tokens = result.as_numpy("output_ids").reshape(-1).tolist()
                        infos = _token_infos(result, tokens)
                        for info, start in zip(infos, self._starts(choice.ids, tokens),
                                               strict=False):
                            info.offset = start
                        yield index, choice.add(text.reshape(-1)[0].decode(), tokens, infos)
                expected = len(call.prompts) * call.params.num_return_sequences
                stopped = [c for c in call.choices.values() if c.finish_reason]
                if final or len(stopped) == expected:
                    break
        except (InferenceServerException, grpc.RpcError) as exc:
            raise _lost_or_api_error(exc) from None
        finally:
            done.set()
            stream.cancel()  # a client gone, or every choice stopped: Triton cancels it
            await client.close()
        for index, choice in sorted(call.choices.items()):
            yield index, choice.finish(call.params.max_tokens, call.params.end_id)


    def _starts(self, before: list[int], tokens: list[int]) -> list[int]:
        """Where each token's text starts in the text ``tokens`` add after ``before`` (a
        response of a stream that fell behind holds several)."""
        context = before[-CONTEXT_TOKENS:]
        return [len(new_text(self.tokenizer, context, tokens[:i])) for i in range(len(tokens))]


def _token_infos(result, tokens: list[int]) -> list[TokenInfo]:
    """One response's tokens with their log-probs (none if the request did not ask)."""
    log_probs = result.as_numpy("output_log_probs")
    if log_probs is None:
        return []
    top_ids, top = result.as_numpy("output_top_log_prob_ids"), result.as_numpy(
        "output_top_log_probs")
    k = 0 if top is None else top.shape[-1]
    alternatives = ([[]] * len(tokens) if not k else [
        list(zip(i.tolist(), p.tolist(), strict=True))
        for i, p in zip(top_ids.reshape(-1, k), top.reshape(-1, k), strict=True)])
    return [TokenInfo(t, p, a, 0) for t, p, a in
            zip(tokens, log_probs.reshape(-1).tolist(), alternatives, strict=True)]


class _FrontendLost(Exception):
    """The frontend could not be reached (or went away); ``error``: what a client sees if no
    other frontend takes the request."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


def _lost_or_api_error(error: InferenceServerException | grpc.RpcError
                       ) -> _FrontendLost | ApiError:
    """:func:`_api_error`, as :class:`_FrontendLost` where the frontend itself is gone (not
    its word that no node can serve: another frontend shares its nodes)."""
    api = _api_error(error)
    gone = (is_unreachable(error) if isinstance(error, InferenceServerException)
            else error.code() == grpc.StatusCode.UNAVAILABLE)
    return _FrontendLost(api) if gone and UNAVAILABLE not in str(api) else api


def _api_error(error: InferenceServerException | grpc.RpcError) -> ApiError:
    """Triton unreachable, the model missing or no node able to serve: 503; no answer
    within ``TIMEOUT_S`` (a slow cluster, reruns after a fault): 504; else the request was
    refused: 400. A model's error on a gRPC stream is text only: the frontend leads it with
    ``UNAVAILABLE`` when no node could serve."""
    if isinstance(error, InferenceServerException):
        status, message = str(error.status() or ""), error.message() or str(error)
    else:  # the stream itself failed (e.g. nothing listens at the address)
        status, message = str(error.code()), error.details() or str(error)
    if "DEADLINE_EXCEEDED" in status:  # the server's own deadline, not a bad request
        return ApiError(504, f"no answer from Triton within {TIMEOUT_S:.0f} s: {message}",
                        "timeout")
    if "UNAVAILABLE" in status or "NOT_FOUND" in status or UNAVAILABLE in message:
        return ApiError(503, message, "service_unavailable")
    return ApiError(400, message)


async def _unless_disconnected(request: Request, work: Awaitable) -> object:
    """``work``'s result, or, if the HTTP client leaves first, ``work`` cancelled (its gRPC
    stream with it: the T-node frees the request) and a response nobody reads."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nginx's "client closed request"


def _log_probs_asked(body: _Sampling) -> tuple[bool, int]:
    """(log-probs wanted, alternatives per token): completions' ``logprobs`` is the number
    of alternatives; chat's is a flag, with ``top_logprobs`` the number."""
    if isinstance(body, ChatRequest):
        asked, top, name = bool(body.logprobs), body.top_logprobs or 0, "top_logprobs"
        if top and not asked:
            raise ApiError(400, f"top_logprobs {top} needs logprobs true", param=name)
    else:
        if body.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is for chat: completions take logprobs as the "
                                "number of alternatives", param="top_logprobs")
        if isinstance(body.logprobs, bool):
            raise ApiError(400, f"logprobs must be an integer for completions, got "
                                f"{body.logprobs}", param="logprobs")
        asked, top, name = body.logprobs is not None, body.logprobs or 0, "logprobs"
    if not 0 <= top <= MAX_TOP_LOG_PROBS:
        raise ApiError(400, f"{name} {top} is not supported: at most {MAX_TOP_LOG_PROBS} "
                            "alternatives per token", param=name)
    return asked, top


def _utf8_size(text: str, param: str) -> int:
    """``text``'s UTF-8 size; a 400 if it has none (a lone surrogate such as ``\\ud800``,
    which JSON allows and UTF-8 does not)."""
    try:
        return len(text.encode())
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} is not valid Unicode: {exc.reason} at character "
                            f"{exc.start}", param=param) from None


def _refuse_unsupported(body: _Sampling) -> None:
    if getattr(body, "echo", False):
        raise ApiError(400, "echo is not supported by this server", param="echo")
    for name, value in (body.model_extra or {}).items():
        if value not in (None, False, [], {}, ""):
            raise ApiError(400, f"{name} is not supported by this server (got {value!r})",
                           param=name)


def create_app(server: OpenAIServer, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="dejavu OpenAI-compatible API")
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)  # unknown route, wrong method, 413
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = ApiError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})  # 405's Allow, 413's Connection
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:])
        return ApiError(400, f"{param}: {first['msg']}", param=param).response()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "dejavu"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        call = await server.prepare(body, prompts, body.max_tokens)
        return await _unless_disconnected(
            request, _answer(server, body, call, "text_completion", "cmpl"))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        max_tokens = body.max_completion_tokens or body.max_tokens
        call = await server.prepare(body, [server.chat_prompt(body)], max_tokens)
        return await _unless_disconnected(
            request, _answer(server, body, call, "chat.completion", "chatcmpl"))

    return app


async def _answer(server: OpenAIServer, body: _Sampling, call: Call, kind: str, prefix: str):
    chat = kind == "chat.completion"
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": server.model_name}
    if not body.stream:
        async for _ in server.run(call):
            pass
        choices = []
        for index, choice in sorted(call.choices.items()):
            content = ({"message": {"role": "assistant", "content": choice.text}} if chat
                       else {"text": choice.text})
            choices.append({"index": index, **content,
                            "logprobs": server.log_probs(call, choice, chat),
                            "finish_reason": choice.finish_reason})
        return {**head, "object": kind, "choices": choices, "usage": call.usage()}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_kind = "chat.completion.chunk" if chat else kind
    stream = server.run(call)
    # The first response (or error) comes before the HTTP status is sent, so a refused
    # request gets its 400 and not an event. Once streaming, a client that leaves cancels
    # the events (Starlette listens for the disconnect), and with them the gRPC stream.
    first = await anext(stream, None)

    def event(index: int, text: str, finish: str | None, role: bool = False,
              log_probs: dict | None = None) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": log_probs,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": log_probs,
                      "finish_reason": finish}
        chunk = {**head, "object": chunk_kind, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n".encode()

    async def events() -> AsyncIterator[bytes]:
        greeted: set[int] = set()
        pending = [first] if first is not None else []
        try:
            async for index, text in _chain(pending, stream):
                log_probs = server.log_probs(call, call.choices[index], chat)
                if text or log_probs or index not in greeted:
                    yield event(index, text, None, index not in greeted, log_probs)
                    greeted.add(index)
            for index, choice in sorted(call.choices.items()):
                yield event(index, "", choice.finish_reason)
        except ApiError as exc:  # after the status went out: an error event
            yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n".encode()
        if include_usage:
            usage = {**head, "object": chunk_kind, "choices": [], "usage": call.usage()}
            yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", required=True,
                        help="the frontend's Triton gRPC address, or several, comma-separated "
                        "(dejavu up --frontends N): requests in turn, and to the next if one "
                        "is unreachable")
    parser.add_argument("--model-dir", required=True, type=Path, help="tokenizer, config")
    parser.add_argument("--model-name", default="", help="the id clients use (default: dir name)")
    parser.add_argument("--triton-model", default="tensorrt_llm_bls",
                        choices=["ensemble", "tensorrt_llm_bls"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help="a larger request body is refused (413) before it is parsed")
    parser.add_argument("--max-prompt-bytes", type=int, default=None,
                        help="a longer prompt is refused before it is tokenized (default: "
                             "the context times the tokenizer's longest token)")
    parser.add_argument("--standby", type=Path, metavar="FIFO",
                        help="a warm spare: load, then serve only once FIFO is opened for "
                        "writing (the cluster's supervisor keeps one)")
    args = parser.parse_args(argv)
    import uvicorn

    server = OpenAIServer(args.grpc_url, args.model_dir, args.model_name, args.triton_model,
                          args.max_prompt_bytes)
    app = create_app(server, args.max_body_bytes)
    if args.standby is not None:
        # Read and write (Linux): the open returns at once, so the FIFO shows as held, and
        # the read waits for the supervisor's byte.
        go = os.open(args.standby, os.O_RDWR)
        os.read(go, 1)
        os.close(go)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
