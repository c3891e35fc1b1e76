"""Frontend, decoupled: split a batched request into sequences, route each to a P-node and a
token pipeline, relay their tokens. Serves the ensemble only: each row's ``input_auth`` must
be preprocessing's signature of its ``input_ids``."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator.control.auth import check_prompt
from orchestrator.serving import pb
from orchestrator.serving.batch import BatchReply, split
from orchestrator.serving.frontend import Cancelled, Frontend
from orchestrator.serving.limits import RequestLimits
from orchestrator.serving.params import INPUTS, RequestError
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
            self.pool.submit(self.serve, request, time.time_ns())
        return None

    def serve(self, request, arrival_ns):
        sender = request.get_response_sender()

        def send(tokens, context, meta, final):
            response = pb.response(output_ids=pb.ids([tokens]), context_ids=pb.ids([context]),
                                   meta=pb.strings(meta).reshape(1, 1))
            pb.send(sender, response, final)

        def send_error(message, final):
            pb.send(sender, pb.error(message), final)

        self.count(+1)
        outcome = "failed"
        try:
            # Everything a client can get wrong is refused here, before any node works.
            tensors = pb.inputs(request, ["input_ids", "input_lengths", "input_auth", *INPUTS])
            jobs = split(tensors, self.check_row)
            reply = BatchReply(jobs, send, send_error, self.frontend.depth, arrival_ns)
            reply.run(self.frontend.generate, pb.cancelled(request))
            outcome = "finished"
        except Cancelled:  # Triton already closed the stream when is_cancelled() said so
            outcome = "cancelled"
        except RequestError as exc:
            outcome = "refused"
            pb.send(sender, pb.refused(str(exc)), final=True)
        except Exception as exc:
            send_error(str(exc), True)
        finally:
            self.count(-1)
            self.metrics.request_done(outcome)

    def check_row(self, ids, signature, params):
        prompt = self.limits.check_ids(ids)
        check_prompt(self.secret, signature, pb.ids(prompt).tobytes())
        check_prompt_fits(prompt, params, self.limits.max_seq_len, self.limits.vocab_size)

    def count(self, change):
        with self.lock:
            self.held += change
            self.metrics.queue_length(self.held)

    def finalize(self):
        self.frontend.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
