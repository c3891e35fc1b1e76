"""T-node, decoupled: one stage of a token pipeline, served by a process of its own that this
model relays to (:mod:`orchestrator.serving.service_process`). ``op`` absent (or
``generate``): admit a request and stream each token as it is made (stage 0), on its own
stream or on the token feed it names (``feed``); ``feed``: open a token feed to the
frontend's listener (``peers``), one message per step for all the requests on it; else a
control request (bootstrap, KV reservation, recovery, ``end`` of a request whose client
left or of a feed) answered with one final ``reply``. Every request must be signed with
the cluster secret; failures come back as ``error_code`` and ``error``."""

from orchestrator.control.errors import ErrorCode, code_of
from orchestrator.engine.log_probs import encode as encode_log_probs
from orchestrator.serving import pb
from orchestrator.serving.control_request import ControlRequest
from orchestrator.serving.params import GenerationParams
from orchestrator.serving.service_process import ServiceProcess


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.verifier = pb.verifier(config)
        self.service = ServiceProcess(config.to_json(), pb.TritonMetrics(config.name))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            tensors = pb.inputs(request, ["op", "peers", "input_ids", "params", "feed",
                                          "kv_since"])
            prompt = [] if tensors["input_ids"] is None else tensors["input_ids"].reshape(-1)

            def fail(message, code=ErrorCode.PIPELINE_LOST, sender=sender):
                pb.send(sender, pb.failure(code, f"decode: {message}"), final=True)

            try:
                op = "generate" if tensors["op"] is None else pb.text(tensors["op"])
                pb.check_signed(request, self.verifier, "decode", op)
                if op == "feed":  # peers: the frontend's feed listener
                    self.service.open_feed(request.request_id(), pb.text(tensors["peers"]),
                                           lambda sender=sender: pb.send_final(sender),
                                           pb.cancelled(request))
                    continue
                if op != "generate":
                    peers = () if tensors["peers"] is None else tuple(tensors["peers"].reshape(-1))
                    reply = self.service.control(
                        op, ControlRequest(request.request_id(), len(prompt), peers))
                    pb.send(sender, pb.response(reply=pb.strings(reply)), final=True)
                    continue

                def emit(tokens, log_probs, final, cached_tokens=0, kv_events=None,
                         sender=sender):
                    outputs = {"output_ids": pb.ids(tokens)}
                    if log_probs is not None:
                        outputs["log_probs"] = pb.strings(encode_log_probs(log_probs))
                    if cached_tokens:
                        outputs["cached_tokens"] = pb.ids([cached_tokens])
                    if kv_events is not None:
                        outputs["kv_events"] = pb.strings(kv_events)
                    pb.send(sender, pb.response(**outputs), final)

                def send_ticket(ticket, sender=sender):
                    pb.send(sender, pb.response(kv_ticket=pb.strings(ticket)))

                self.service.admit(
                    request.request_id(),
                    prompt.tolist(),
                    GenerationParams.from_json(tensors["params"]),
                    emit,
                    fail,
                    pb.cancelled(request),
                    send_ticket,
                    None if tensors["feed"] is None else pb.text(tensors["feed"]),
                    None if tensors["kv_since"] is None else pb.text(tensors["kv_since"]),
                )
            except Exception as exc:  # a refused request must not hurt the others
                self.service.metrics.request_done("failed")
                fail(str(exc), code_of(exc))
        return None

    def finalize(self):
        self.service.stop()

