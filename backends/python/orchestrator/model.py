"""Frontend, decoupled: route each request to a P-node and a T-node, relay tokens. Serves the
ensemble only: ``input_auth`` must be preprocessing's signature of ``input_ids``."""

import threading
from concurrent.futures import ThreadPoolExecutor

from orchestrator.control.auth import check_prompt
from orchestrator.serving import pb
from orchestrator.serving.frontend import Cancelled, Frontend
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.params import PARAM_TENSORS, GenerationParams, RequestError
from orchestrator.serving.params import check_prompt as check_prompt_fits


class TritonPythonModel:
    def initialize(self, args):
        config = pb.node_config(args)
        self.secret = config.secret()
        self.metrics = pb.TritonMetrics(config.name or "frontend")
        self.frontend = Frontend(list(config.prefill_urls), [list(p) for p in config.decode_urls],
                                 self.secret, controller=config.controller, metrics=self.metrics)
        self.limits = RequestLimits.for_node(config)
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
            # Everything a client can get wrong is refused here, before any node works.
            tensors = pb.inputs(request, ["input_ids", "input_auth", *PARAM_TENSORS])
            prompt = self.limits.check_ids(tensors["input_ids"])
            signature = None if tensors["input_auth"] is None else pb.text(tensors["input_auth"])
            check_prompt(self.secret, signature, pb.ids(prompt).tobytes())
            params = GenerationParams.from_tensors(tensors)
            check_prompt_fits(prompt, params, self.limits.max_seq_len, self.limits.vocab_size)
            self.frontend.generate(prompt, params, emit, pb.cancelled(request))
            outcome = "finished"
        except Cancelled:  # Triton already closed the stream when is_cancelled() said so
            outcome = "cancelled"
        except RequestError as exc:
            outcome = "refused"
            pb.send(sender, pb.refused(str(exc)), final=True)
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
