"""The calls TensorRT-LLM's stock ``llmapi_client.py`` makes, our own code (its
``triton_backend/tools/`` copy stays out of the repository): a unary ``async_infer`` with
``parameters={'Streaming': ...}`` and a request id; ``-S`` (and an early stop) on a gRPC
stream; a stop request (``text_input`` empty, ``stop`` true, the same request id); a
request cancel (the future's ``cancel()``, ``stop_stream(cancel_requests=True)``)."""

from __future__ import annotations

import queue
from functools import partial

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

MODEL = "tensorrt_llm"
TIMEOUT_S = 120.0


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    made = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    made.set_data_from_numpy(array)
    return made


def request_inputs(prompt: str, max_tokens: int | None = None, **more: np.ndarray
                   ) -> list[grpcclient.InferInput]:
    """The client's ``_prepare_inputs``: ``text_input`` ``[1]`` and
    ``sampling_param_max_tokens`` ``[1]`` (``None``: left out), and ``more``."""
    arrays = {"text_input": np.array([prompt], dtype=object)}
    if max_tokens is not None:
        arrays["sampling_param_max_tokens"] = np.array([max_tokens], np.int32)
    return [tensor(k, v) for k, v in (arrays | more).items()]


def stop_inputs() -> list[grpcclient.InferInput]:
    """The client's ``prepare_stop_signals``."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
              grpcclient.InferInput("stop", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.empty([1], dtype=np.bytes_))
    inputs[1].set_data_from_numpy(np.array([True], dtype="bool"))
    return inputs


class Unary:
    """A unary ``async_infer`` (the client without ``-S``), its result awaited with
    :meth:`result`."""

    def __init__(self, url: str, inputs: list, request_id: str = "1",
                 streaming: bool = False) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.future = self.client.async_infer(
            MODEL, inputs, request_id=request_id, callback=self._done,
            parameters={"Streaming": streaming}, client_timeout=TIMEOUT_S)

    def _done(self, result, error) -> None:
        self.results.put(error or result)

    def stop(self, request_id: str = "1"):
        """The client's stop request, unary: its answer (an exception, CANCELLED)."""
        answers: queue.Queue = queue.Queue()
        self.client.async_infer(MODEL, stop_inputs(), request_id=request_id,
                                callback=lambda result, error: answers.put(error or result),
                                parameters={"Streaming": False}, client_timeout=TIMEOUT_S)
        return answers.get(timeout=TIMEOUT_S)

    def result(self):
        try:
            return self.results.get(timeout=TIMEOUT_S)
        finally:
            self.client.close()


def unary(url: str, inputs: list, request_id: str = "1", streaming: bool = False):
    """One unary call's result (or the exception it got)."""
    return Unary(url, inputs, request_id, streaming).result()


class Stream:
    """The client on a gRPC stream (``-S``, or any early stop): the request, then maybe a
    stop request on the same stream; every answer in order."""

    def __init__(self, url: str, inputs: list, request_id: str = "1",
                 streaming: bool = True) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue = queue.Queue()
        self.streaming = streaming
        self.client.start_stream(callback=partial(lambda q, result, error: q.put(error or result),
                                                  self.answers), stream_timeout=TIMEOUT_S)
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id,
                                       parameters={"Streaming": streaming})

    def next(self):
        return self.answers.get(timeout=TIMEOUT_S)

    def stop(self, request_id: str = "1") -> None:
        self.client.async_stream_infer(MODEL, stop_inputs(), request_id=request_id,
                                       parameters={"Streaming": self.streaming})

    def cancel(self) -> None:
        """``--stop-via-request-cancel`` on a stream."""
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> list:
        """Waits for the stream's last answer; every answer not read yet."""
        self.client.stop_stream()
        self.client.close()
        return [self.answers.get_nowait() for _ in range(self.answers.qsize())]


def text(result) -> str:
    """What the client prints: ``as_numpy("text_output")[0].decode("utf-8")``."""
    return result.as_numpy("text_output")[0].decode("utf-8")


def is_cancelled(answer) -> bool:
    """The client's test of an answer: "Request is cancelled"."""
    if not isinstance(answer, InferenceServerException):
        return False
    message = str(answer).lower()
    return (answer.status() == "StatusCode.CANCELLED" or "cancelled by client" in message
            or "request cancelled" in message)
