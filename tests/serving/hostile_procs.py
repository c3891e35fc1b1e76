"""A spawned client sending a huge prompt on command, so that building and sending it
takes none of the measuring process's time (nor its GIL)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient
from spawned import serve
from tritonclient.utils import InferenceServerException


def stream(client: grpcclient.InferenceServerClient, model_name: str, inputs):
    """Every response of one decoupled request; raises its error."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model_name, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=30)
            if error is not None:
                raise error
            yield result
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)


def huge_prompt_sender(url: str, nbytes: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """``("send",)`` -> (seconds until the answer, the error it got or "")."""
    client = grpcclient.InferenceServerClient(url)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"w" * nbytes]], dtype=np.object_))  # serialized once
    tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[8]], dtype=np.int32))

    def send() -> tuple[float, str]:
        start = time.monotonic()
        try:
            list(stream(client, "ensemble", [text, tokens]))
            error = ""
        except InferenceServerException as exc:
            error = exc.message()
        return time.monotonic() - start, error

    outbox.put((True, None))  # ready
    serve({"send": send}, client.close, inbox, outbox)
