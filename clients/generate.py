"""``dejavu generate``: text through the ensemble over HTTP or gRPC, printed as it streams.

HTTP uses Triton's generate extension (``/v2/models/<m>/generate`` and
``generate_stream``); gRPC uses a bidirectional stream (the ensemble is
decoupled, so plain HTTP ``infer`` is not available). Without ``--url`` the
frontend of the cluster in ``--dir`` (``dejavu up``) is used.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

TIMEOUT_S = 120.0
# ensemble input -> numpy dtype / Triton dtype of its [batch, 1] tensor (stop_words and
# bad_words: [batch, words] strings)
PARAMETERS = {
    "max_tokens": (np.int32, "INT32"),
    "end_id": (np.int32, "INT32"),
    "pad_id": (np.int32, "INT32"),
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "seed": (np.uint64, "UINT64"),
    "random_seed": (np.uint64, "UINT64"),
    "min_tokens": (np.int32, "INT32"),
    "repetition_penalty": (np.float32, "FP32"),
    "presence_penalty": (np.float32, "FP32"),
    "frequency_penalty": (np.float32, "FP32"),
    "num_return_sequences": (np.int32, "INT32"),
    "exclude_input_in_output": (np.bool_, "BOOL"),
    "return_perf_metrics": (np.bool_, "BOOL"),
    "return_log_probs": (np.bool_, "BOOL"),
    "top_log_probs": (np.int32, "INT32"),
    "beam_width": (np.int32, "INT32"),
    "stream": (np.bool_, "BOOL"),
    "stop_words": (np.object_, "BYTES"),
    "bad_words": (np.object_, "BYTES"),
}


class GenerateError(RuntimeError):
    """The server refused or failed the request; the message is the server's, ``status`` its
    gRPC status (``StatusCode.INVALID_ARGUMENT``: a client error), if any."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    text: str
    ids: list[int]
    # with return_log_probs: each new token's log-prob, the sum so far, and with
    # top_log_probs each token's likeliest (id, log-prob)
    log_probs: list[float] | None = None
    cum_log_prob: float | None = None
    top: list[list[tuple[int, float]]] | None = None


def stream_http(url: str, prompt: str, stream: bool = True, model: str = "ensemble", **params):
    """Chunks from ``generate_stream`` (or one from ``generate`` when not streaming)."""
    body = json.dumps({"text_input": prompt, "stream": stream, **params}).encode()
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", body)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            if not stream:
                yield _chunk(json.loads(response.read()))
                return
            for line in response:
                if line.startswith(b"data:"):
                    yield _chunk(json.loads(line[len(b"data:") :]))
    except urllib.error.HTTPError as exc:
        body = exc.read().strip().removeprefix(b"data:")  # generate_stream errors are events too
        raise GenerateError(json.loads(body).get("error", str(exc))) from None


def _chunk(message: dict) -> Chunk:
    if "error" in message:
        raise GenerateError(message["error"])
    ids = message.get("output_ids", [])
    return Chunk(message["text_output"], ids if isinstance(ids, list) else [ids])


def stream_grpc(
    url: str, prompt: str, stream: bool = True, model: str = "ensemble", **params
) -> Iterator[Chunk]:
    for result in stream_results(url, model, _inputs([prompt], stream, params)):
        yield _grpc_chunk(result)


def generate_batch(
    url: str, prompts: list[str], stream: bool = True, model: str = "ensemble", **params
) -> dict[tuple[int, int], list[Chunk]]:
    """Several prompts in one gRPC request (``[batch, 1]`` tensors, the same parameters for
    every row); each sequence's chunks by (``batch_index``, ``sequence_index``)."""
    chunks: dict[tuple[int, int], list[Chunk]] = {}
    for result in stream_results(url, model, _inputs(prompts, stream, params)):
        key = (int(result.as_numpy("batch_index").reshape(-1)[0]),
               int(result.as_numpy("sequence_index").reshape(-1)[0]))
        chunks.setdefault(key, []).append(_grpc_chunk(result))
    return chunks


def _grpc_chunk(result) -> Chunk:
    chunk = Chunk(result.as_numpy("text_output").reshape(-1)[0].decode(),
                  result.as_numpy("output_ids").reshape(-1).tolist())
    log_probs = result.as_numpy("output_log_probs")
    if log_probs is not None:
        chunk.log_probs = log_probs.reshape(-1).tolist()
        chunk.cum_log_prob = float(result.as_numpy("cum_log_probs").reshape(-1)[0])
    top = result.as_numpy("output_top_log_probs")
    if top is not None:
        ids = result.as_numpy("output_top_log_prob_ids")
        k = top.shape[-1]
        chunk.top = [list(zip(i.tolist(), p.tolist(), strict=True))
                     for i, p in zip(ids.reshape(-1, k), top.reshape(-1, k), strict=True)]
    return chunk


def _inputs(prompts: list[str], stream: bool, params: dict) -> list:
    """``[batch, 1]`` tensors (``[batch, words]`` for stop/bad words), one row per prompt."""
    import tritonclient.grpc as grpcclient

    values = {"text_input": np.array([[p.encode()] for p in prompts], dtype=np.object_)}
    for name, value in {**params, "stream": stream}.items():
        row = [w.encode() for w in value] if name in ("stop_words", "bad_words") else [value]
        values[name] = np.array([row] * len(prompts), dtype=PARAMETERS[name][0])
    inputs = []
    for name, array in values.items():
        dtype = "BYTES" if name == "text_input" else PARAMETERS[name][1]
        inputs.append(grpcclient.InferInput(name, list(array.shape), dtype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def stream_results(url: str, model: str, inputs: list) -> Iterator:
    """The results of one request on a gRPC stream, until its final flag."""
    import tritonclient.grpc as grpcclient

    from orchestrator.control.client import stop_stream

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    done = False
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while not done:
            try:
                result, error = responses.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise GenerateError(f"no response from {url} in {TIMEOUT_S:.0f} s") from None
            if error is not None:
                raise GenerateError(error.message(), error.status())
            done = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("output_ids") is not None:  # the empty final has no tensors
                yield result
    finally:
        # Leaving early (an error, a consumer that stops) cancels the request on the server.
        stop_stream(client, cancel=not done)
        client.close()


def frontend_url(run_dir: str, protocol: str) -> str:
    from orchestrator.cluster.launcher import read_state

    return read_state(run_dir)["frontend"][protocol]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dejavu generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", help="host:port of the frontend (default: from --dir)")
    parser.add_argument("--dir", default="runs/local", help="cluster folder of `dejavu up`")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--end-id", type=int)
    parser.add_argument("--temperature", type=float,
                        help="applies when sampling: greedy unless --top-k > 1 or --top-p > 0")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--model", default="ensemble")
    args = parser.parse_args(argv)
    try:
        url = args.url or frontend_url(args.dir, args.protocol)
    except FileNotFoundError as exc:
        print(f"dejavu generate: {exc}; pass --url", file=sys.stderr)
        return 1
    params = {
        name: getattr(args, name)
        for name in ("max_tokens", "end_id", "temperature", "top_k", "top_p", "seed")
        if getattr(args, name) is not None
    }
    run = stream_http if args.protocol == "http" else stream_grpc
    try:
        for chunk in run(url, args.prompt, stream=args.stream, model=args.model, **params):
            print(chunk.text, end="", flush=True)
    except (GenerateError, OSError) as exc:
        print(f"\ndejavu generate: {exc}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
