"""Glue between Triton's Python backend and the serving library (import inside a stub only).

The models in ``backends/python`` stay thin: read tensors with :func:`inputs`,
call the library, answer with :func:`response` or :func:`error`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from orchestrator.control.auth import WINDOW_S, Verifier
from orchestrator.control.errors import ErrorCode
from orchestrator.serving.batch import SequenceJob
from orchestrator.serving.config import NodeConfig
from orchestrator.serving.entry import EntryPoint, Replies
from orchestrator.serving.metrics import PublishedMetrics, Series
from orchestrator.serving.params import as_text

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Every call below talks to tritonserver through the stub's shared memory. Made from
# many threads at once (one per request, the token loop, KV waits) they crashed
# tritonserver 2.51 (SIGSEGV in libtriton_python, boost lock_exception): one at a time.
_ipc = threading.Lock()


def send(sender, response: pb_utils.InferenceResponse, final: bool = False) -> None:
    with _ipc:
        sender.send(response, flags=FINAL if final else 0)


def send_final(sender) -> None:
    """The final flag alone (a cancelled request's: Triton releases it only then)."""
    with _ipc:
        sender.send(flags=FINAL)


# A frontend request asks Triton whether its client left at most this often: each question
# is an IPC round trip holding the stub's GIL, and its waits (a seat, a free slot, the
# P-node, its tokens) asked every 50 ms: with 64 streams as many round trips as responses.
FRONTEND_CANCEL_CHECK_S = 0.1


def cancelled(request, at_most_every_s: float = 0.0) -> Callable[[], bool]:
    """Whether ``request``'s client left, asked of Triton at most every ``at_most_every_s``
    (the answer in between: the last one)."""
    asked_at, answer = [-at_most_every_s], [False]

    def is_cancelled() -> bool:
        now = time.monotonic()
        if not answer[0] and now - asked_at[0] >= at_most_every_s:
            asked_at[0] = now
            with _ipc:
                answer[0] = request.is_cancelled()
        return answer[0]

    return is_cancelled


def replies(request, respond: Callable[[list[int], list[int], dict], dict[str, np.ndarray]]
            ) -> Replies:
    """How a frontend entry point answers ``request``; ``respond``: a sequence's response
    tensors from (tokens, context tokens, meta)."""
    sender = request.get_response_sender()
    return Replies(
        lambda tokens, context, meta, final: send(
            sender, response(**respond(tokens, context, meta)), final),
        lambda message, final: send(sender, error(message), final),
        lambda message: send(sender, refused(message), final=True),
        lambda: send_final(sender),
    )


def serve(entry: EntryPoint, requests: list,
          jobs: Callable[[object], list[SequenceJob]],
          respond: Callable[[list[int], list[int], dict], dict[str, np.ndarray]]) -> None:
    """A frontend entry model's ``execute``: hand each request to ``entry``'s pool, which
    reads it with ``jobs`` and answers through its response sender (decoupled)."""
    for request in requests:
        entry.submit(lambda request=request: jobs(request), replies(request, respond),
                     cancelled(request, FRONTEND_CANCEL_CHECK_S))


def node_config(args: dict) -> NodeConfig:
    """The node's configuration: the model's ``config`` parameter in config.pbtxt."""
    parameters = json.loads(args["model_config"]).get("parameters", {})
    if "config" not in parameters:
        raise ValueError("the model has no 'config' parameter: write its repository with "
                         "`dejavu up` or `dejavu repo`")
    return NodeConfig.from_json(parameters["config"]["string_value"])


def decoupled(args: dict) -> bool:
    """Whether the model is deployed decoupled (its config's model_transaction_policy)."""
    return pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))


def inputs(request, names: list[str]) -> dict[str, np.ndarray | None]:
    """Each named input as numpy, ``None`` where an optional input was not sent."""
    found = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        found[name] = None if tensor is None else tensor.as_numpy()
    return found


def parameters(request) -> dict[str, object]:
    """A request's parameters (``parameters=`` of a tritonclient call)."""
    with _ipc:
        return json.loads(request.parameters() or "{}")


def text(array: np.ndarray) -> str:
    """One string from a ``[1]`` or ``[1, 1]`` BYTES tensor."""
    if array.size != 1:
        raise ValueError(f"expected one string, got shape {list(array.shape)}")
    return as_text(array.reshape(-1)[0])


def response(**arrays: np.ndarray) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in arrays.items()])


def error(message: str) -> pb_utils.InferenceResponse:
    """A failure answered to a client (its message is all it gets)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def failure(code: ErrorCode, message: str) -> pb_utils.InferenceResponse:
    """An internal model's failure: the caller acts on ``error_code``, people read ``error``."""
    return response(error_code=np.array([int(code)], dtype=np.int32), error=strings(message))


def verifier(config: NodeConfig) -> Verifier:
    """How an internal node checks the requests sent to it (at its own address). A call
    waits in Triton's queue behind a busy node before it is checked: under ``time_scale``
    K that wait is K times longer, so the signature's window is too (a P-node 16 prefills
    deep at K = 8 saw 20 s old signatures)."""
    return Verifier(config.secret(), config.address, window_s=WINDOW_S * config.time_scale)


def check_signed(request, verifier: Verifier, model: str, op: str) -> None:
    """Raises Unauthenticated unless the whole request (every input) is signed with the
    cluster secret for this node, fresh, and not seen before."""
    with _ipc:
        parameters, request_id = request.parameters(), request.request_id()
        tensors = {t.name(): t.as_numpy() for t in request.inputs()}
    verifier.check_request(parameters, model, op, request_id, tensors)


def cancelled_error(message: str) -> pb_utils.InferenceResponse:
    """A request ended by its client (gRPC CANCELLED)."""
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED))


def refused(message: str) -> pb_utils.InferenceResponse:
    """The request itself is wrong: a client error (HTTP 400, gRPC INVALID_ARGUMENT)."""
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


def ids(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def strings(*values: str | bytes) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


class TritonMetrics(PublishedMetrics):
    """The project's counters as Triton custom metrics, labelled by node (and by ``model``
    where two models of one node count the same thing: the frontend's entry points)."""

    # what is counted -> (family name, help, gauge?, its label's name or "")
    FAMILIES = {
        "requests": ("dejavu_requests", "requests by outcome", False, "outcome"),
        "queue_length": ("dejavu_queue_length", "requests held", True, ""),
        "kv_bytes": ("dejavu_kv_bytes", "KV bytes streamed", False, ""),
        "kv_seconds": ("dejavu_kv_transfer_seconds", "time KV transfers were open", False, ""),
        "kv_ahead_bytes": ("dejavu_kv_ahead_bytes", "of the KV bytes streamed, a P-node's "
                           "cached positions, sent before the rest was computed", False, ""),
        "kv_reused_bytes": ("dejavu_kv_reused_bytes", "prompt KV a T-node already held: not "
                            "streamed (decode-side reuse)", False, ""),
        "held": ("dejavu_held", "request resources held", True, "what"),
        "reruns": ("dejavu_reruns", "prompts or requests run again", False, "what"),
        "reattached": ("dejavu_reattached", "requests re-attached to a new head", False, ""),
        # since start: lookup_tokens, hit_tokens, evicted_blocks, hit_rate (hit / lookup
        # tokens); now: bytes held, budget_bytes
        "prefix_cache": ("dejavu_prefix_cache", "the node's prefix cache", True, "what"),
        # the frontend, disaggregated: admission (the T-node's KV ticket), prefill_call
        "leg_seconds": ("dejavu_leg_seconds", "time on a leg of the way to the first token",
                        False, "what"),
        "legs": ("dejavu_legs", "legs of the way to the first token", False, "what"),
    }

    def __init__(self, node: str, model: str = "", instance: str = "") -> None:
        """``instance``: a model instance's name, where several instances count the same
        thing (their gauges are series of their own; a sum over them is the model's)."""
        self.labels = {"node": node, **({"model": model} if model else {}),
                       **({"instance": instance} if instance else {})}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self.families = {what: pb_utils.MetricFamily(name, text, gauge if is_gauge else counter)
                         for what, (name, text, is_gauge, _) in self.FAMILIES.items()}
        self.series: dict[Series, object] = {}  # made on first use
        super().__init__()

    def publish(self, added: dict[Series, float], gauges: dict[Series, float]) -> None:
        with _ipc:
            for series, amount in added.items():
                self._metric(series).increment(amount)
            for series, value in gauges.items():
                self._metric(series).set(value)

    def _metric(self, series: Series):  # noqa: ANN202  (a pb_utils Metric)
        if series not in self.series:
            what, value = series
            label = self.FAMILIES[what][3]
            self.series[series] = self.families[what].Metric(
                labels={**self.labels, **({label: value} if label else {})})
        return self.series[series]
