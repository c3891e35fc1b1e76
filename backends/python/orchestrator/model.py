"""Frontend, decoupled: route each request to a P-node and a T-node, relay tokens. Serves the
ensemble only: ``input_auth`` must be preprocessing's signature of ``input_ids``."""

import threading
from concurrent.futures import ThreadPoolExecutor

from orchestrator.control.auth import check_prompt
from orchestrator.serving import pb
from orchestrator.serving.frontend import Cancelled, Frontend
from orchestrator.serving.params import PARAM_TENSORS, GenerationParams


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.secret = config.secret()
        self.frontend = Frontend(list(config.prefill_urls), [list(p) for p in config.decode_urls],
                                 self.secret, controller=config.controller)
        self.metrics = pb.TritonMetrics(config.name or "frontend")
        self.held, self.lock = 0, threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=config.max_requests)

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self.serve, request)
        return None

    def serve(self, request):
        sender = request.get_response_sender()

        def emit(tokens, context, final):
            response = pb.response(output_ids=pb.ids(tokens), context_ids=pb.ids(context))
            pb.send(sender, response, final)

        self.count(+1)
        outcome = "failed"
        try:
            tensors = pb.inputs(request, ["input_ids", "input_auth", *PARAM_TENSORS])
            signature = None if tensors["input_auth"] is None else pb.text(tensors["input_auth"])
            check_prompt(self.secret, signature, pb.ids(tensors["input_ids"]).tobytes())
            params = GenerationParams.from_tensors(tensors)
            prompt = tensors["input_ids"].reshape(-1).tolist()
            self.frontend.generate(prompt, params, emit, pb.cancelled(request))
            outcome = "finished"
        except Cancelled:  # Triton already closed the stream when is_cancelled() said so
            outcome = "cancelled"
        except Exception as exc:
            pb.send(sender, pb.error(str(exc)), final=True)
        finally:
            self.count(-1)
            self.metrics.request_done(outcome)

    def count(self, change):
        with self.lock:
            self.held += change
            self.metrics.queue_length(self.held)

    def finalize(self):
        self.frontend.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
