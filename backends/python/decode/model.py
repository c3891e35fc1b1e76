"""T-node, decoupled: admit into the token loop, stream each token as it is made."""

from orchestrator.serving import pb
from orchestrator.serving.node import load_decode_service
from orchestrator.serving.params import PARAM_TENSORS, GenerationParams


class TritonPythonModel:
    def initialize(self, args):
        params = pb.parameters(args)
        self.service = load_decode_service(params, pb.TritonMetrics(params["name"]))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            tensors = pb.inputs(request, ["input_ids", *PARAM_TENSORS])

            def emit(tokens, final, sender=sender):
                pb.send(sender, pb.response(output_ids=pb.ids(tokens)), final)

            def fail(message, sender=sender):
                pb.send(sender, pb.error(f"decode: {message}"), final=True)

            def send_ticket(ticket, sender=sender):
                pb.send(sender, pb.response(kv_ticket=pb.strings(ticket)))

            try:
                self.service.admit(
                    request.request_id(),
                    tensors["input_ids"].reshape(-1).tolist(),
                    GenerationParams.from_tensors(tensors),
                    emit,
                    fail,
                    pb.cancelled(request),
                    send_ticket,
                )
            except Exception as exc:  # a refused request must not hurt the others
                self.service.metrics.request_done("failed")
                fail(str(exc))
        return None

    def finalize(self):
        self.service.stop()
