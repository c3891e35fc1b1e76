"""tensorrt_llm_bls, decoupled: the ensemble under the backend's BLS name. Each request goes
through the ensemble unchanged (BLS) and every response comes back; the final flag
follows the last."""

import json
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from orchestrator.serving import pb


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.outputs = [output["name"] for output in config["output"]]
        self.pool = ThreadPoolExecutor(max_workers=64)

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self.relay, request)
        return None

    def relay(self, request):
        sender = request.get_response_sender()
        inner = pb_utils.InferenceRequest(model_name="ensemble", inputs=request.inputs(),
                                          requested_output_names=self.outputs)
        try:
            for response in inner.exec(decoupled=True):
                if response.has_error():
                    pb.send(sender, pb.error(response.error().message()), final=True)
                    return
                if response.output_tensors():
                    pb.send(sender, pb_utils.InferenceResponse(response.output_tensors()))
        except Exception as exc:  # e.g. the ensemble could not be reached
            pb.send(sender, pb.error(f"tensorrt_llm_bls: {exc}"), final=True)
            return
        pb.send_final(sender)

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
